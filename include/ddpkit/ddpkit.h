// Everything a training program needs from ddpkit.
#pragma once
#include <ddpkit/codecs/cast.h>
#include <ddpkit/codecs/quantize.h>
#include <ddpkit/comm/host_topology.h>
#include <ddpkit/comm/process_group.h>
#include <ddpkit/runtime/checkpoint.h>
#include <ddpkit/runtime/runtime.h>
#include <ddpkit/ddp/distributed_data_parallel.h>
#include <ddpkit/hooks/default_hooks.h>
#include <ddpkit/hooks/fsdp_hooks.h>
#include <ddpkit/hooks/optimizer_hook.h>
#include <ddpkit/hooks/post_local_sgd_hook.h>
#include <ddpkit/hooks/powersgd_hook.h>
#include <ddpkit/hooks/quantization_hooks.h>
#include <ddpkit/reducer/reducer.h>
#include <ddpkit/zero/ddp_zero_hook.h>
#include <ddpkit/zero/zero_redundancy_optimizer.h>
