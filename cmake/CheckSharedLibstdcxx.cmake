# cmake -DREADELF=... -DLIBS="a.so|b.so" -DCXX=... -P CheckSharedLibstdcxx.cmake
# Fails when a library does not load the shared libstdc++: a Python process already has one (torch's),
# and a second copy linked in statically keeps locale state of its own that was never set up, so the
# first stream it formats crashes (seen with a compiler wrapper that adds -static-libstdc++).
string(REPLACE "|" ";" LIBS "${LIBS}")
foreach(lib IN LISTS LIBS)
  execute_process(COMMAND ${READELF} -d ${lib} OUTPUT_VARIABLE out RESULT_VARIABLE rc)
  if(rc EQUAL 0 AND NOT out MATCHES "libstdc\\+\\+\\.so")
    file(REMOVE ${lib})  # else the next build would call it up to date
    message(FATAL_ERROR "ddpkit python: ${lib} does not load the shared libstdc++ (its NEEDED entries name no "
            "libstdc++.so): the compiler ${CXX} linked libstdc++ into it statically, and inside a Python process "
            "that second copy crashes. Build with a compiler that links the shared one, e.g. CXX=/usr/bin/g++ "
            "(docs/compat.md, 'pip torch').")
  endif()
endforeach()
