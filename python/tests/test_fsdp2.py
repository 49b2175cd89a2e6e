"""FSDP2 (torch.distributed.fsdp.fully_shard) on the ddpkit backend, CPU: 2 and 3 ranks of FSDP and
4 ranks of HSDP (a 2 x 2 mesh: replicate x shard) train the batches a single process trains, with
SGD and AdamW, in fp32 and with a bf16 MixedPrecisionPolicy, and must end where it ends. The same
runs on Gloo tell whether pytorch#162338 (FSDP2's AVG reduce-scatter summed on Gloo) holds. Then
ddpkit's FSDP hooks as FSDP2's collectives (ddpkit.fsdp2: the plain, fp16 and bf16 reduce-scatter,
and HSDP by hand with ReplicateHook) against the same single process, within each codec's bound.

fully_shard runs on CPU from torch 2.7 on (docs/python.md, "FSDP2"): on 2.6 it stops in its
all-gather (torch.cpu.Stream has no record_event, added in pytorch#145935), so these tests skip
below 2.7."""
import pytest
import torch

from conftest import TORCH_MINOR, run_ranks

pytestmark = pytest.mark.skipif(TORCH_MINOR < (2, 7),
                                reason="fully_shard runs on CPU from torch 2.7 (2.6: torch.cpu.Stream has no "
                                       "record_event, raised in its all-gather)")

STEPS = 4
BATCH = 24        # divisible by 2, 3 and 4 ranks: every rank trains an equal share of each batch
FP32_TOLERANCE = 1e-6    # relative, on every parameter (the bound)
# Relative, on every parameter's update: bf16 rounds each rank's partial sums where the single
# process rounds the whole batch's (AdamW HSDP measured 3.4e-2, the same on Gloo bit for bit). A sum
# in place of the average (pytorch#162338) moves SGD's update by (world - 1) x 100 %.
BF16_TOLERANCE = 5e-2


def make_model():
    torch.manual_seed(0)
    # Sizes that 2, 3 and 4 do not all divide: FSDP2 pads the dim-0 shards.
    return torch.nn.Sequential(torch.nn.Linear(10, 33), torch.nn.ReLU(), torch.nn.Linear(33, 17), torch.nn.ReLU(),
                               torch.nn.Linear(17, 5))


def batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, 10, generator=g), torch.randn(BATCH, 5, generator=g)) for _ in range(STEPS)]


def make_optimizer(name, params, lr_scale=1.0):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05 * lr_scale, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def train_single_process(optimizer_name, precision, lr_scale=1.0):
    """The reference: one process, the whole batch. With bf16, as FSDP2's policy computes: the
    forward and backward in bf16 copies of the fp32 parameters, gradients back in fp32."""
    model = make_model()
    opt = make_optimizer(optimizer_name, model.parameters(), lr_scale)
    for x, y in batches():
        opt.zero_grad()
        if precision == "bf16":
            low = make_model().to(torch.bfloat16)
            with torch.no_grad():
                for p_low, p in zip(low.parameters(), model.parameters()):
                    p_low.copy_(p)
            out = low(x.to(torch.bfloat16)).float()
            torch.nn.functional.mse_loss(out, y).backward()
            for p_low, p in zip(low.parameters(), model.parameters()):
                p.grad = p_low.grad.float()
        else:
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train_fsdp2(rank, world, optimizer_name, precision, mesh_shape, divide_factor=None, codec=None,
                replicate_by_hook=False):
    """codec: ddpkit.fsdp2's reduce-scatter of that codec in place of FSDP2's own; with
    replicate_by_hook, a 2-D mesh_shape is sharded on its "shard" dim only and ddpkit's
    ReplicateHook averages across "replicate" (HSDP by hand)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model()
    replicate_group = None
    if len(mesh_shape) == 2:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        if replicate_by_hook:
            replicate_group = mesh["replicate"].get_group()
            mesh = mesh["shard"]
    else:
        mesh = init_device_mesh("cpu", mesh_shape)
    policy = MixedPrecisionPolicy()
    if precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if divide_factor is not None:  # FSDP2 then reduce-scatters with PREMUL_SUM(1 / factor)
        for m in model.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(divide_factor)
    if codec is not None or replicate_group is not None:
        import ddpkit.fsdp2
        ddpkit.fsdp2.set_comm_hooks(model, codec or "none", replicate_group=replicate_group)
    opt = make_optimizer(optimizer_name, model.parameters())
    share = BATCH // world
    for x, y in batches():
        opt.zero_grad()
        mine = slice(rank * share, (rank + 1) * share)
        out = model(x[mine])
        torch.nn.functional.mse_loss(out.float(), y[mine]).backward()
        opt.step()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def compare(rank, world, configs, **fsdp_options):
    """Every configuration on this world; for each, the largest relative difference of any
    parameter from the single-process run (fp32: of the parameter; bf16 or a compressing codec:
    of its update)."""
    initial = [p.detach().clone() for p in make_model().parameters()]
    results = {}
    for optimizer_name, precision, mesh_shape in configs:
        got = train_fsdp2(rank, world, optimizer_name, precision, mesh_shape, **fsdp_options)
        want = train_single_process(optimizer_name, precision)
        worst = 0.0
        for g, w, p0 in zip(got, want, initial):
            if precision == "bf16" or fsdp_options.get("codec") in ("fp16", "bf16"):
                worst = max(worst, ((g - w).norm() / (w - p0).norm()).item())
            else:
                worst = max(worst, ((g - w).abs().max() / w.abs().max()).item())
        results[(optimizer_name, precision, mesh_shape)] = worst
    return results


def run(backend, world, configs, limit_of=None, **fsdp_options):
    results = run_ranks(compare, world, configs, backend=backend, timeout=300, kwargs=fsdp_options)
    assert all(r == results[0] for r in results[1:]), f"ranks disagree: {results}"
    bad = {}
    for key, worst in results[0].items():
        limit = BF16_TOLERANCE if key[1] == "bf16" else FP32_TOLERANCE
        if limit_of is not None:
            limit = limit_of(key)
        print(f"{backend} world {world} {key} {fsdp_options}: max relative difference {worst:.3g} (limit {limit:g})")
        if not worst <= limit:
            bad[key] = worst
    assert not bad, f"{backend}: FSDP2 differs from single-process training: {bad}"
    return results[0]


FSDP_CONFIGS = [(opt, precision, None) for opt in ("sgd", "adamw") for precision in ("fp32", "bf16")]
HSDP_CONFIGS = [(opt, precision, (2, 2)) for opt in ("sgd", "adamw") for precision in ("fp32", "bf16")]


def _configs(world):
    if world == 4:
        return HSDP_CONFIGS
    return [(o, p, (world,)) for o, p, _ in FSDP_CONFIGS]


@pytest.mark.parametrize("world", [2, 3, 4], ids=["fsdp-2", "fsdp-3", "hsdp-2x2"])
@pytest.mark.parametrize("backend", ["ddpkit", "gloo"])
def test_fully_shard_matches_single_process_training(backend, world):
    if backend == "gloo" and TORCH_MINOR < (2, 15):
        # pytorch#162338: on 2.7.1 FSDP2's AVG reduce-scatter sums on Gloo (gradients x world);
        # 2.15.0 averages. Releases between were not tried.
        pytest.xfail("pytorch#162338: FSDP2 on Gloo sums where it averages (2.7.1; fixed in 2.15.0)")
    run(backend, world, _configs(world))


def summed_gradients(rank, world):
    """set_gradient_divide_factor(1.0): gradients summed, not averaged (FSDP2 reduce-scatters with
    PREMUL_SUM(1.0)); SGD then steps as the single process does at world x the rate."""
    try:
        got = train_fsdp2(rank, world, "sgd", "fp32", (world,), divide_factor=1.0)
    except RuntimeError as e:
        return str(e)
    want = train_single_process("sgd", "fp32", lr_scale=world)
    return max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))


@pytest.mark.parametrize("backend", ["ddpkit", "gloo"])
def test_gradient_divide_factor_reduces_with_premul_sum(backend):
    results = run_ranks(summed_gradients, 2, backend=backend, timeout=300)
    if backend == "gloo":  # Gloo refuses the op FSDP2 then uses
        assert all(isinstance(r, str) and "PREMUL_SUM" in r for r in results), results
        return
    assert all(isinstance(r, float) and r <= FP32_TOLERANCE for r in results), results


# ---- ddpkit's FSDP hooks as FSDP2's collectives (ddpkit.fsdp2) -------------------------------

# A compressing codec rounds each rank's gradient and the reduced result to its precision (unit
# roundoff u: 2^-8 bf16, 2^-11 fp16); the sum accumulates in fp32. Bound on the relative error of
# each parameter's update after STEPS steps: 8u. Measured on 2.15 (fp32 compute): SGD <= 0.7u,
# AdamW <= 6.3u with bf16 and 0.6u with fp16 (Adam's g / sqrt(v) magnifies a rounded gradient near 0).
CODEC_TOLERANCE = {"none": FP32_TOLERANCE, "fp16": 8 * 2.0 ** -11, "bf16": 8 * 2.0 ** -8}


def _codec_limit(codec):
    def limit(key):
        if key[1] == "bf16":  # bf16 compute: its own bound, plus the codec's rounding
            return BF16_TOLERANCE + CODEC_TOLERANCE[codec]
        return CODEC_TOLERANCE[codec]
    return limit


ddpkit_fsdp2 = pytest.mark.skipif(TORCH_MINOR < (2, 9), reason="set_custom_reduce_scatter is in FSDP2 from torch 2.9")


@ddpkit_fsdp2
@pytest.mark.parametrize("codec", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("world", [2, 3], ids=["fsdp-2", "fsdp-3"])
def test_ddpkit_reduce_scatter_matches_single_process_training(codec, world):
    worst = run("ddpkit", world, _configs(world), limit_of=_codec_limit(codec), codec=codec)
    if codec != "none":  # the codec's rounding shows: FSDP2 ran ddpkit's reduce-scatter, not its own
        assert all(w > FP32_TOLERANCE for key, w in worst.items() if key[1] == "fp32"), worst


@ddpkit_fsdp2
@pytest.mark.parametrize("codec", ["none", "bf16"])
def test_ddpkit_replicate_hook_is_hsdp(codec):
    """Sharded within pairs, replicated across them by ddpkit's ReplicateHook: HSDP's result."""
    configs = [(opt, "fp32", (2, 2)) for opt in ("sgd", "adamw")]
    run("ddpkit", 4, configs, limit_of=_codec_limit(codec), codec=codec, replicate_by_hook=True)


def hooks_on_gloo(rank, world):
    from torch.distributed.fsdp import fully_shard
    import ddpkit.fsdp2
    model = make_model()
    fully_shard(model)
    ddpkit.fsdp2.set_comm_hooks(model, "bf16")
    try:
        torch.nn.functional.mse_loss(model(torch.randn(4, 10)), torch.randn(4, 5)).backward()
    except ValueError as e:
        return str(e)
    return "trained"


@ddpkit_fsdp2
def test_ddpkit_comm_hooks_name_a_group_of_another_backend():
    for message in run_ranks(hooks_on_gloo, 2, backend="gloo", timeout=120):
        assert "not of the ddpkit backend" in message and "init_process_group('ddpkit')" in message, message


@ddpkit_fsdp2
def test_set_comm_hooks_checks_its_arguments():
    import ddpkit.fsdp2
    with pytest.raises(ValueError, match="codec must be one of none, fp16, bf16"):
        ddpkit.fsdp2.ReduceScatter("int8")
    with pytest.raises(ValueError, match="no module in it is fully_shard"):
        ddpkit.fsdp2.set_comm_hooks(make_model(), "bf16")
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        ddpkit.fsdp2.set_comm_hooks("model")
