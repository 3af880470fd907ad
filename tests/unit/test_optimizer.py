"""The policy optimizer: bfloat16 parameters take AdamW's float32 updates (torch.optim.AdamW on float32
copies is the reference), gradients accumulate in float32, the main copies survive a checkpoint."""

import copy

import pytest
import torch

from specroll_mcore.optimizer import ExpertSplitAdamW, MainParamAdamW, zero_owners
from specroll_mcore.parallel import grad_of

ADAMW = {"lr": 1e-6, "betas": (0.9, 0.99), "weight_decay": 0.01}


@pytest.fixture(autouse=True, scope="module")
def warm_intra_op_threads():
    """The comparisons below are bit for bit, and so is torch: except that an intra-op worker thread's
    first vectorised float32 ``sqrt`` in a process (AdamW's denominator, 2048+ elements) sometimes
    rounds by another implementation, 1 ulp off for most of that thread's half (seen in 1 process of 20
    on a 2-core AMX Xeon; never with one thread, never on a later call). One call first keeps the
    optimizer under test and its ``torch.optim.AdamW`` reference on the same one."""
    torch.rand(1 << 16).sqrt()


def bf16_param(n: int = 4096, seed: int = 0) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter((0.02 * torch.randn(n, generator=g)).bfloat16())


def backward(p: torch.Tensor, c: torch.Tensor) -> None:
    """A loss whose gradient with respect to ``p`` is ``c`` (bfloat16-representable)."""
    (p.float() * c).sum().backward()


def test_bfloat16_parameters_take_the_float32_updates():
    p = bf16_param()
    c = torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).bfloat16().float()
    ref = torch.nn.Parameter(p.detach().float().clone())
    ref_opt = torch.optim.AdamW([ref], **ADAMW)
    plain = torch.nn.Parameter(p.detach().clone())
    plain_opt = torch.optim.AdamW([plain], **ADAMW)
    opt = MainParamAdamW([p], **ADAMW)
    start = p.detach().clone()
    for _ in range(200):  # 200 steps of 1e-6: a few bfloat16 spacings of a 0.02 weight
        opt.zero_grad()
        backward(p, c)
        assert p.grad is None and p.main_grad.dtype == torch.float32
        opt.step()
        ref.grad = c.clone()
        ref_opt.step()
        plain.grad = c.bfloat16()
        plain_opt.step()
    assert torch.equal(opt.main[0], ref.detach())
    assert torch.equal(p.detach(), ref.detach().bfloat16())
    assert (p.detach() != start).float().mean() > 0.5
    # plain AdamW on the bfloat16 weights rounds most updates away
    assert (plain.detach() == ref.detach().bfloat16()).float().mean() < 0.5


def test_micro_batch_gradients_accumulate_in_float32():
    p = bf16_param(8)
    opt = MainParamAdamW([p], **ADAMW)
    c1 = torch.tensor([1.0, 2.0, 3.0, 4.0, 1e-3, 5e-3, 256.0, 3.0]).bfloat16().float()
    c2 = torch.tensor([1e-3, 1e-3, 1e-3, 1e-3, 1.0, 1.0, 1.0, 1.0]).bfloat16().float()
    backward(p, c1)
    backward(p, c2)
    assert p.grad is None and torch.equal(grad_of(p), c1 + c2)
    assert not torch.equal((c1.bfloat16() + c2.bfloat16()).float(), c1 + c2)  # what bfloat16 accumulation loses
    opt.zero_grad()
    assert grad_of(p) is None


def test_float32_parameters_step_exactly_as_adamw():
    w = torch.nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(2)))
    ref = torch.nn.Parameter(w.detach().clone())
    opt, ref_opt = MainParamAdamW([w], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2)
    for k in range(3):
        for q, o in ((w, opt), (ref, ref_opt)):
            o.zero_grad()
            (q * (k + 1)).pow(2).sum().backward()
            o.step()
    assert torch.equal(w.detach(), ref.detach())
    assert opt.main[0] is w and not hasattr(w, "main_grad")
    assert set(opt.state_dict()) == set(ref_opt.state_dict())  # same format as before: old checkpoints load


def test_a_checkpoint_resumes_the_float32_main_weights():
    c = torch.randn(4096, generator=torch.Generator().manual_seed(3)).bfloat16().float()
    p = bf16_param()
    opt = MainParamAdamW([p], **ADAMW)

    def steps(q, o, n):
        for _ in range(n):
            o.zero_grad()
            backward(q, c)
            o.step()

    steps(p, opt, 5)
    saved_model, saved_opt = p.detach().clone(), copy.deepcopy(opt.state_dict())  # as torch.save would keep them
    assert torch.equal(saved_opt["main_params"][0], opt.main[0])
    q = torch.nn.Parameter(saved_model)  # the model shard as saved: bfloat16
    resumed = MainParamAdamW([q], **ADAMW)
    resumed.load_state_dict(saved_opt)
    steps(p, opt, 5)
    steps(q, resumed, 5)
    assert torch.equal(resumed.main[0], opt.main[0]) and torch.equal(q.detach(), p.detach())
    # without main copies (an older half-precision checkpoint) the model weights seed them
    old = {k: v for k, v in saved_opt.items() if k != "main_params"}
    r = MainParamAdamW([torch.nn.Parameter(saved_model.clone())], **ADAMW)
    r.load_state_dict(old)
    assert torch.equal(r.main[0], saved_model.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_decay_spares_what_no_weight_decay_names(dtype):
    """With zero gradients AdamW's step is its decoupled decay alone: matrices shrink by lr x wd,
    the 1-D parameters (biases, norms) that ``no_weight_decay`` names stay as they are."""
    w, b = torch.nn.Parameter(torch.ones(3, 4, dtype=dtype)), torch.nn.Parameter(torch.ones(4, dtype=dtype))
    opt = MainParamAdamW([w, b], no_weight_decay=lambda p: p.ndim < 2, lr=0.1, weight_decay=0.5)
    for p in (w, b):
        if dtype == torch.bfloat16:
            p.main_grad = torch.zeros(p.shape)
        else:
            p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(w.detach(), torch.full((3, 4), 0.95, dtype=torch.float32).to(dtype))
    assert torch.equal(b.detach(), torch.ones(4, dtype=dtype))
    same = MainParamAdamW([torch.nn.Parameter(torch.ones(4))], no_weight_decay=lambda p: p.ndim < 2, lr=0.1,
                          weight_decay=0.0)
    assert len(same.optimizer.param_groups) == 1  # no decay: the state keeps one group, as before


def test_optimizer_errors():
    with pytest.raises(ValueError, match="float16 training needs loss scaling.*--dtype bfloat16"):
        MainParamAdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))], lr=1e-6)
    opt = MainParamAdamW([bf16_param(8)], **ADAMW)
    other = MainParamAdamW([bf16_param(16)], **ADAMW)
    with pytest.raises(ValueError, match="saved by another model or layout"):
        other.load_state_dict(opt.state_dict())


def test_sharded_parameters_are_dealt_out_as_zero_redundancy_optimizer_deals_them(ctx):
    """zero_owners is torch's ZeroRedundancyOptimizer's partition (whose sharded states a sharded
    optimizer loads as they are): two parameter groups of uneven sizes with ties, over 3 replicas,
    against the partition torch computes for them (its own method, on a group of one process asked
    for 3 parts)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    sizes = [[10, 30, 20, 30, 5, 7], [3, 64, 3, 1]]
    params = [[torch.nn.Parameter(torch.zeros(n)) for n in group] for group in sizes]
    zero = ZeroRedundancyOptimizer([{"params": g} for g in params], torch.optim.AdamW, lr=1e-3)
    zero.world_size, zero._partition_parameters_cache = 3, []
    theirs = zero._partition_parameters()  # per replica, per group: its parameters in order
    ours = zero_owners(sizes, 3)
    for r in range(3):
        for g, group in enumerate(params):
            assert [id(p) for p in theirs[r][g]["params"]] == [id(group[i]) for i, o in ours[g].items() if o == r]
    assert ours[0] == {1: 0, 3: 1, 2: 2, 0: 2, 5: 0, 4: 1}  # (by hand: largest first, to the emptiest)


def test_a_sharded_state_does_not_load_into_an_unsharded_optimizer():
    opt = MainParamAdamW([bf16_param(8)], **ADAMW)
    state = {**opt.state_dict(), "zero_shard": [1, 2]}
    with pytest.raises(ValueError, match="shard 1 of 2 data-parallel replicas, this run's is unsharded: resume with"):
        opt.load_state_dict(state)


def test_expert_split_optimizer_steps_both_parts_and_checks_what_it_resumes():
    """The two parts of ExpertSplitAdamW (the sharding itself runs at DP=2 in
    tests/dist/test_expert_parallel.py) take AdamW's steps as one optimizer over all parameters, and
    its state resumes, while the state of an optimizer saved without it is refused by name."""
    dense, expert = bf16_param(64, seed=1), bf16_param(32, seed=2)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in (dense, expert)]
    opt, ref_opt = ExpertSplitAdamW([dense], [expert], None, None, **ADAMW), MainParamAdamW(ref, **ADAMW)
    c = [torch.randn(p.shape, generator=torch.Generator().manual_seed(3)).bfloat16().float() for p in ref]
    for _ in range(2):
        for o, ps in ((opt, (dense, expert)), (ref_opt, ref)):
            o.zero_grad()
            for p, g in zip(ps, c):
                backward(p, g)
            o.step()
    assert torch.equal(dense, ref[0]) and torch.equal(expert, ref[1])
    resumed = ExpertSplitAdamW([bf16_param(64, seed=1)], [bf16_param(32, seed=2)], None, None, **ADAMW)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert torch.equal(resumed.parts["experts"].main[0], opt.parts["experts"].main[0])
    with pytest.raises(ValueError, match="was not saved with expert parallelism and a sharded optimizer"):
        resumed.load_state_dict(ref_opt.state_dict())


def test_a_state_loaded_by_name_continues_as_the_saved_one():
    """The state dict names each state's parameter (decayed and undecayed groups hold them in another
    order than the parameters); the states loaded by name, into an optimizer over the same parameters
    listed in another order, continue bit for bit as the saved optimizer does; so do float32 parameters
    beside bfloat16 ones (no main copy). Step counts are each parameter's."""
    def params():
        return [bf16_param(64, 0), torch.nn.Parameter(torch.zeros(8).bfloat16()),
                torch.nn.Parameter(bf16_param(32, 2).detach().float())]

    names = ["a.weight", "norm.weight", "b.weight"]
    coeffs = [torch.randn(p.shape, generator=torch.Generator().manual_seed(10 + i)) for i, p in enumerate(params())]
    one_d = dict(no_weight_decay=lambda p: p.shape[0] == 8, **ADAMW)  # (the 'norm')

    def steps(opt, ps, order, n):
        for _ in range(n):
            opt.zero_grad()
            for i, p in zip(order, ps):
                backward(p, coeffs[i])
            opt.step()

    ps = params()
    opt = MainParamAdamW(ps, names=names, **one_d)
    steps(opt, ps, [0, 1, 2], 3)
    state = copy.deepcopy(opt.state_dict())  # (its tensors are the optimizer's own)
    assert state["state_names"] == ["a.weight", "b.weight", "norm.weight"]  # (the undecayed group last)
    assert state["main_names"] == ["a.weight", "norm.weight"]
    by_name = {k: {n: state["state"][i][k] for i, n in enumerate(state["state_names"])}
               for k in ("exp_avg", "exp_avg_sq")}
    main = dict(zip(state["main_names"], state["main_params"]))
    saved = [p.detach().clone() for p in ps]
    steps(opt, ps, [0, 1, 2], 2)

    order = [2, 0, 1]
    qs = [torch.nn.Parameter(saved[i].clone()) for i in order]
    other = MainParamAdamW(qs, names=[names[i] for i in order], **one_d)
    other.load_named_state(by_name, dict.fromkeys(names, 3), main)
    steps(other, qs, order, 2)
    for q, i in zip(qs, order):
        assert torch.equal(q.detach(), ps[i].detach()), names[i]
    assert torch.equal(other.main[1], opt.main[0])  # a's float32 main copy
    with pytest.raises(ValueError, match="without its parameters' names"):
        MainParamAdamW(params(), **ADAMW).load_named_state(by_name, dict.fromkeys(names, 3), main)
    with pytest.raises(ValueError, match="3 names for 2 parameters"):
        MainParamAdamW(params()[:2], names=names, **ADAMW)
    short = {k: {n: t[:4] if n == "a.weight" else t for n, t in v.items()} for k, v in by_name.items()}
    with pytest.raises(ValueError, match=r"a.weight: the optimizer state has shape \(4,\), the parameter \(64,\)"):
        MainParamAdamW(params(), names=names, **ADAMW).load_named_state(short, dict.fromkeys(names, 3), main)
    # a parameter without a step count keeps no state (one that never took a step)
    fresh = MainParamAdamW(params(), names=names, **ADAMW)
    fresh.load_named_state(by_name, {"a.weight": 3, "b.weight": 2}, main)
    assert [float(fresh.optimizer.state[m]["step"]) if m in fresh.optimizer.state else None
            for m in fresh.main] == [3.0, None, 2.0]
