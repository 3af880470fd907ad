"""Training checkpoints: policy shards, optimizer, RNG, trainer state and heads, every N steps.

Layout (a Megatron-LM checkpoint directory, so `specroll convert mcore-to-hf` reads it):

    OUT/specroll_config.json, tokenizer files
    OUT/latest_checkpointed_iteration.txt           N (written last, atomically)
    OUT/iter_000000N/mp_rank_TT[_PPP]/model_optim_rng.pt   model shard, optimizer state, RNG
    OUT/iter_000000N/mp_rank_TT[_PPP]/optim_dpR.pt  optimizer state of DP replica R > 0 (sharded only)
    OUT/iter_000000N/mp_rank_TT[_PPP]/optim_epE.pt  optimizer state of expert-parallel rank E > 0 (its
                                                    experts' AdamW state; the model shard holds every expert)
    OUT/iter_000000N/trainer_state.json             step, data position, policy version, counters
    OUT/iter_000000N/layout.json                    the parallel layout it was saved in
    OUT/iter_000000N/heads.pt                       unsharded heads + what they are tied to
    OUT/iter_000000N/engine_state_dpR.pt            SpecRoll engine: slow-path records, monitor, time
                                                    accounts, tree-size calibration (per DP replica)

Every rank writes its files into ``OUT/.iter_000000N.tmp`` and fsyncs them; after a barrier rank 0
fsyncs the tree's directories, renames it into place and fsyncs ``OUT``, then replaces the tracker file
(temp file + rename, ``OUT`` fsynced again) and removes iterations beyond ``keep_last``. A kill at
any moment, or a crash of the machine, leaves either the previous complete checkpoint or the new
one, never a partial directory that the tracker points at.

Every rank writes into the one ``OUT``, which rank 0 renames: ``OUT`` must be one directory every rank
sees (a shared file system at the same path on every node, as Megatron-LM's ``--save``); the trainer
checks that before it trains (:func:`check_shared_directory`).

A run resumes at the layout it was saved in by loading each rank's files as they are. At another
layout (TP, PP and its split of the layers, EP, DP with the optimizer states sharded, sharded or not)
the weights and AdamW's states are gathered into their full form from the saved shards, parameter by
parameter (the optimizer's state dict names them, routed experts by their global number), and split
for the new layout, as a converted checkpoint is; every data-parallel replica that had a SpecRoll
engine state gets its own back, a new one starts without.
"""

from __future__ import annotations

import copy
import json
import os
import secrets
import shutil
import socket
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Optional

import torch

from specroll_mcore.checkpoint.megatron import (CHECKPOINT_VERSION, HEADS_FILE, LAYOUT_FILE, TRACKER_FILE,
                                                MegatronCheckpointReader, _fsync_tree, fsync_dir, iteration_dir,
                                                iteration_layout, iteration_name, shard_dir_name,
                                                write_text_atomic)
from specroll_mcore.checkpoint.shard import full_name, local_state_dict
from specroll_mcore.optimizer import MAIN_NAMES, MAIN_PARAMS, STATE_NAMES

STATE_FILE = "trainer_state.json"
ENGINE_STATE_FILE = "engine_state_dp{dp}.pt"
OPTIMIZER_SHARD_FILE = "optim_dp{dp}.pt"  # a sharded optimizer's state on data-parallel replica dp > 0
EXPERT_OPTIMIZER_FILE = "optim_ep{ep}.pt"  # the optimizer state of expert-parallel rank ep > 0
OLD_ENGINE_STATE_FILE = "slow_path_dp{dp}.pt"  # checkpoints written before the tree-size calibration

SHARED_CHECK_WAIT_S = 30.0
"""How long a rank looks for the file rank 0 left in the output directory before it calls the
directory not shared (a network file system can show another node's new file only once its
caches are refreshed)."""


def check_shared_directory(ctx: Any, directory: Path, wait_s: Optional[float] = None) -> None:
    """Raise on every rank unless every rank sees ``directory`` as rank 0 does (collective). Each rank
    writes its part of a checkpoint into it and rank 0 renames the whole and names it in the tracker:
    on a directory of each node's own (a node-local disk, or a relative path from other working
    directories) a checkpoint would hold rank 0's node's files alone, and a resume would find it on
    one node and not on the others. Rank 0 leaves a file of a random name there (the name goes to
    every rank by an all-reduce) and removes it once every rank has looked for it, for up to
    ``wait_s`` (default :data:`SHARED_CHECK_WAIT_S`)."""
    if ctx.world_size == 1:
        return
    wait_s = SHARED_CHECK_WAIT_S if wait_s is None else wait_s
    token = torch.tensor([float(secrets.randbits(52) + 1) if ctx.rank == 0 else 0.0], dtype=torch.float64)
    token = int(ctx.all_reduce_max(token).item())
    probe = Path(directory) / f".shared-check-{token}"
    if ctx.rank == 0:
        write_text_atomic(probe, socket.gethostname())
    ctx.barrier()
    deadline = time.monotonic() + wait_s
    while not probe.is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    missing = [r for r, m in enumerate(ctx.gather_values(float(not probe.is_file()))) if m]
    if ctx.rank == 0:
        probe.unlink(missing_ok=True)
    if missing:
        raise RuntimeError(f"TrainConfig.output_dir {directory} is not one directory every rank shares: rank(s) "
                           f"{missing} of {ctx.world_size} do not see the file rank 0 wrote there within {wait_s:g} s "
                           f"(this is rank {ctx.rank} on {socket.gethostname()}). Every rank writes its part of a "
                           "checkpoint into it and rank 0 renames the whole: give an absolute path on a file system "
                           "every node mounts at that path (NFS, Lustre, GPFS), as for Megatron-LM's --save")


def training_layout(policy: Any, optimizer: Any) -> dict[str, Any]:
    """What a training checkpoint records of the layout it was saved in (LAYOUT_FILE)."""
    ctx = policy.ctx
    return {"tensor_model_parallel_size": ctx.tp_size, "pipeline_model_parallel_size": ctx.pp_size,
            "pipeline_stage_layers": ctx.stage_layers(policy.config.num_layers), "data_parallel_size": ctx.dp_size,
            "expert_model_parallel_size": ctx.ep_size, "shard_optimizer": getattr(optimizer, "shard", None) is not None,
            "named_optimizer_state": getattr(optimizer, "names", None) is not None}


def layout_changes(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """How ``here`` differs from the layout ``saved`` in what a resume must load differently (the data-
    parallel size only where the optimizer states are split over it)."""
    keys = ["tensor_model_parallel_size", "pipeline_model_parallel_size", "pipeline_stage_layers",
            "expert_model_parallel_size", "shard_optimizer"]
    if saved["shard_optimizer"] or here["shard_optimizer"]:
        keys.append("data_parallel_size")
    return [f"{k} {saved[k]} -> {here[k]}" for k in keys if saved[k] != here[k]]


def reshard_refusal(saved: dict[str, Any], here: dict[str, Any]) -> Optional[str]:
    """Why a training state saved in layout ``saved`` cannot be resharded for ``here`` (None: it can)."""
    if not saved["named_optimizer_state"] or not here["named_optimizer_state"]:
        return "its optimizer state does not name its parameters; resume with the layout it was saved with"
    return None


def save_training_checkpoint(out_dir: Path, step: int, policy: Any, optimizer: Any,
                             trainer_state: dict[str, Any], heads: Optional[dict[str, torch.Tensor]],
                             heads_meta: dict[str, Any], keep_last: int,
                             engine_state: Optional[dict[str, Any]] = None, background: bool = False
                             ) -> Path | PendingCheckpoint:
    """One training checkpoint, atomically (written to a temporary directory, fsynced, renamed).
    ``heads`` are the full (TP-gathered) head weights; ``engine_state`` this replica's SpecRoll engine
    state (slow-path records, monitor, time accounts, tree-size calibration: identical on the TP ranks
    of the last stage; each data-parallel replica keeps its own). A collective: every rank calls it.

    ``background``: this rank's files are copied (on the host) and written by a thread while training
    goes on (Megatron-LM's ``--async-save``); the checkpoint is renamed into place and named by the
    tracker only by :meth:`PendingCheckpoint.commit`, once every rank's files are written."""
    ctx = policy.ctx
    out_dir = Path(out_dir)
    tmp = out_dir / f".{iteration_name(step)}.tmp"
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    ctx.barrier()
    writes: list[tuple[Any, Path]] = []  # (object, file) this rank writes
    d = tmp / shard_dir_name(ctx.tp_rank, ctx.pp_rank, ctx.pp_size)
    experts = (ctx.ep_rank, ctx.ep_size)
    # data-parallel replicas hold identical weights (and optimizer states, unless sharded), but for the experts
    # split over an expert-parallel group: the one with replica 0 gathers them into the shard (every expert, as
    # without EP), and each of its ranks keeps its experts' optimizer state
    model = policy.expert_state_dict() if ctx.expert_dp_rank == 0 else None
    if ctx.dp_rank == 0:
        if not background:  # (in the background the host copy below is the one copy)
            model = {k: v.cpu() for k, v in model.items()}
        writes.append(({"model": model, "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                        "iteration": step, "checkpoint_version": CHECKPOINT_VERSION, "experts": experts},
                       d / "model_optim_rng.pt"))
    elif getattr(optimizer, "shard", None) is not None:  # this replica's shard of the optimizer state
        # (and, under expert parallelism, of its experts')
        writes.append(({"optimizer": optimizer.state_dict()}, d / OPTIMIZER_SHARD_FILE.format(dp=ctx.dp_rank)))
    elif ctx.expert_dp_rank == 0:  # an expert-parallel rank > 0: its experts' optimizer state
        writes.append(({"optimizer": optimizer.state_dict(), "experts": experts},
                       d / EXPERT_OPTIMIZER_FILE.format(ep=ctx.ep_rank)))
    if heads is not None and ctx.is_last_stage and ctx.tp_rank == 0 and ctx.dp_rank == 0:
        writes.append(({"heads": heads, "meta": heads_meta}, tmp / HEADS_FILE))
    if engine_state is not None and ctx.is_last_stage and ctx.tp_rank == 0:  # one per data-parallel replica
        writes.append((engine_state, tmp / ENGINE_STATE_FILE.format(dp=ctx.dp_rank)))
    if ctx.rank == 0:
        writes += [(json.dumps(trainer_state, indent=2), tmp / STATE_FILE),
                   (json.dumps(training_layout(policy, optimizer), indent=2), tmp / LAYOUT_FILE)]
    pending = PendingCheckpoint(ctx, out_dir, step, keep_last, writes if not background else
                                [(_host_copy(obj), path) for obj, path in writes], background)
    if background:
        return pending
    return pending.commit()


def _host_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied to the host, so that training can go on changing the originals."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v) for v in obj)
    return copy.deepcopy(obj)


class PendingCheckpoint:
    """A training checkpoint whose files this rank writes (in a thread, when in the background) before
    :meth:`commit` renames it into place: a kill or crash before then leaves the previous checkpoint
    the tracker names, as a synchronous save's would."""

    def __init__(self, ctx: Any, out_dir: Path, step: int, keep_last: int, writes: list[tuple[Any, Path]],
                 background: bool) -> None:
        self.ctx, self.out_dir, self.step, self.keep_last = ctx, out_dir, step, keep_last
        self.path = out_dir / iteration_name(step)
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        if background:
            self._thread = threading.Thread(target=self._background, args=(writes,), name=f"save-{step}",
                                            daemon=True)
            self._thread.start()
        else:
            self._write(writes)

    @staticmethod
    def _write(writes: list[tuple[Any, Path]]) -> None:
        """Each file, fsynced by the rank that wrote it (another node's fsync would not flush this one's
        cache; in the background, the wait for the disk is the thread's)."""
        for obj, path in writes:  # (a str is a JSON file's text)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                if isinstance(obj, str):
                    f.write(obj.encode())
                else:
                    torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())

    def _background(self, writes: list[tuple[Any, Path]]) -> None:
        try:
            self._write(writes)
        except BaseException as e:  # (raised by commit, in the training thread)
            self._error = e

    def written(self) -> bool:
        """Whether this rank's files are written (commit would not wait for them)."""
        return self._thread is None or not self._thread.is_alive()

    def commit(self) -> Path:
        """Wait for this rank's files, then (every rank: a collective) rename the checkpoint into place,
        name it in the tracker and remove iterations beyond ``keep_last``."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"writing checkpoint {self.path} failed: {self._error}") from self._error
        ctx, out_dir = self.ctx, self.out_dir
        ctx.barrier()
        if ctx.rank == 0:
            tmp = out_dir / f".{self.path.name}.tmp"
            _fsync_tree(tmp, files=False)  # (each rank fsynced its files)
            shutil.rmtree(self.path, ignore_errors=True)
            os.replace(tmp, self.path)
            fsync_dir(out_dir)  # (the iteration's new name is durable before the tracker names it)
            write_text_atomic(out_dir / TRACKER_FILE, str(self.step))
            iters = sorted(p for p in out_dir.glob("iter_*") if p.is_dir())
            for old in iters[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        ctx.barrier()
        return self.path


def latest_training_checkpoint(out_dir: Path) -> Optional[Path]:
    try:
        d = iteration_dir(out_dir)
    except FileNotFoundError:
        return None
    return d if (d / STATE_FILE).is_file() else None


def agreed_latest_checkpoint(ctx: Any, out_dir: Path) -> Optional[Path]:
    """:func:`latest_training_checkpoint`, the same on every rank (collective): where ranks read
    different latest iterations (a network file system's stale caches, a tracker file replaced while
    they read it) every rank raises, rather than resume from different steps."""
    latest = latest_training_checkpoint(out_dir)
    seen = ctx.gather_values(-1.0 if latest is None else float(zlib.crc32(latest.name.encode())))
    others = [r for r, v in enumerate(seen) if v != seen[0]]
    if others:
        raise RuntimeError(f"the ranks read different latest checkpoints in {out_dir}: rank(s) {others} of "
                           f"{ctx.world_size} another than rank 0 (this is rank {ctx.rank}, reading "
                           f"{latest.name if latest is not None else 'none'}): the file system shows the ranks "
                           "different files; wait until it does not (or check that no other run writes there) and "
                           "resume again")
    return latest


def load_training_checkpoint(iter_dir: Path, policy: Any, optimizer: Any
                             ) -> tuple[dict[str, Any], Optional[dict[str, torch.Tensor]], dict[str, Any],
                                        Optional[dict[str, Any]]]:
    """Restore this rank's model shard, optimizer and RNG; returns (trainer state, heads, heads meta,
    SpecRoll engine state or None). A checkpoint saved at another layout is resharded (see the module's
    docstring)."""
    ctx = policy.ctx
    saved = iteration_layout(iter_dir)
    if saved is not None and layout_changes(saved, training_layout(policy, optimizer)):
        _load_resharded(iter_dir, saved, policy, optimizer)
    else:
        _load_own_shard(iter_dir, policy, optimizer)
    state = json.loads((iter_dir / STATE_FILE).read_text())
    heads, meta = None, {}
    if (iter_dir / HEADS_FILE).is_file():
        h = torch.load(iter_dir / HEADS_FILE, map_location="cpu", weights_only=True)
        heads, meta = h["heads"], h["meta"]
    engine = None
    if ctx.is_last_stage:
        for name in (ENGINE_STATE_FILE, OLD_ENGINE_STATE_FILE):
            if (iter_dir / name.format(dp=ctx.dp_rank)).is_file():
                engine = torch.load(iter_dir / name.format(dp=ctx.dp_rank), map_location="cpu", weights_only=False)
                break
    return state, heads, meta, engine


def _load_own_shard(iter_dir: Path, policy: Any, optimizer: Any) -> None:
    """This rank's files, saved in this layout."""
    ctx = policy.ctx
    path = iter_dir / shard_dir_name(ctx.tp_rank, ctx.pp_rank, ctx.pp_size) / "model_optim_rng.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: resume with the TP/PP layout the checkpoint was saved with")
    blob = torch.load(path, map_location="cpu", weights_only=False)
    policy.load_local_state_dict(blob["model"])
    saved_ep = blob.get("experts", (0, 1))[1]
    if saved_ep != ctx.ep_size:
        raise ValueError(f"{iter_dir} was saved with expert_model_parallel_size {saved_ep}, this run has "
                         f"{ctx.ep_size}: the optimizer state of experts is kept per expert-parallel rank; resume "
                         f"with expert_model_parallel_size {saved_ep}")
    optim = blob["optimizer"]
    if ctx.ep_rank > 0 and getattr(optimizer, "shard", None) is None:
        optim = torch.load(path.parent / EXPERT_OPTIMIZER_FILE.format(ep=ctx.ep_rank), map_location="cpu",
                           weights_only=False)["optimizer"]
    elif ctx.dp_rank > 0 and getattr(optimizer, "shard", None) is not None:
        shard = path.parent / OPTIMIZER_SHARD_FILE.format(dp=ctx.dp_rank)
        if not shard.is_file():
            raise FileNotFoundError(f"{shard} is missing: resume with the TrainConfig.shard_optimizer and "
                                    "data-parallel size the checkpoint was saved with")
        optim = torch.load(shard, map_location="cpu", weights_only=False)["optimizer"]
    optimizer.load_state_dict(optim)
    torch.set_rng_state(blob["rng"])


class _SavedOptimizer:
    """The AdamW states of a checkpoint's saved ranks by parameter: ``part(tp_rank, stage, field)`` is
    one saved (TP rank, stage)'s ``weights``, ``exp_avg``, ``exp_avg_sq`` or float32 ``main`` copies under the
    parameters' local names, over the files of every data-parallel replica and expert-parallel rank
    that holds a part of them (memory-mapped); ``steps`` each parameter's AdamW step count."""

    def __init__(self, iter_dir: Path, saved: dict[str, Any], model: Any) -> None:
        self.iter_dir, self.saved, self.model = iter_dir, saved, model
        self._blobs: dict[tuple[int, int], tuple[dict[str, torch.Tensor], list[dict[str, Any]]]] = {}

    def _states(self, tp_rank: int, stage: int) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
        """The (TP rank, stage)'s weights and each of its AdamW state dicts: replica 0's, and each other
        replica's part of a sharded state, or each other expert-parallel rank's (an ExpertSplitAdamW's
        two parts apart)."""
        if (tp_rank, stage) not in self._blobs:
            d = self.iter_dir / shard_dir_name(tp_rank, stage, self.saved["pipeline_model_parallel_size"])
            dp, ep = self.saved["data_parallel_size"], self.saved["expert_model_parallel_size"]
            files = [d / "model_optim_rng.pt"]
            if self.saved["shard_optimizer"]:
                files += [d / OPTIMIZER_SHARD_FILE.format(dp=r) for r in range(1, dp)]
            else:
                files += [d / EXPERT_OPTIMIZER_FILE.format(ep=r) for r in range(1, ep)]
            weights, states = None, []
            for f in files:
                if not f.is_file():
                    raise FileNotFoundError(f"{f} is missing; the checkpoint is incomplete")
                blob = torch.load(f, map_location="cpu", weights_only=False, mmap=True)
                weights = weights if weights is not None else blob["model"]
                optim = blob["optimizer"]
                states += [optim["dense"], optim["experts"]] if "dense" in optim else [optim]
            self._blobs[tp_rank, stage] = weights, states
        return self._blobs[tp_rank, stage]

    def part(self, tp_rank: int, stage: int, field: str) -> dict[str, torch.Tensor]:
        weights, states = self._states(tp_rank, stage)
        if field == "weights":
            return weights
        out: dict[str, torch.Tensor] = {}
        for optim in states:
            if field == "main":
                out.update(zip(optim[MAIN_NAMES], optim[MAIN_PARAMS]))
            else:
                out.update((name, optim["state"][i][field]) for i, name in enumerate(optim[STATE_NAMES])
                           if i in optim["state"])
        # (a parameter AdamW holds no state for, never stepped: zeros in its place, for the full form;
        # its step count, absent from :meth:`steps`, leaves it without state in the new layout too)
        return {**{k: torch.zeros_like(v) for k, v in weights.items() if k not in out}, **out}

    def steps(self) -> dict[str, float]:
        """Each parameter's AdamW step count (the full form's names; a parameter without state: none)."""
        split = self.saved["pipeline_stage_layers"]
        out: dict[str, float] = {}
        for stage in range(len(split)):
            for optim in self._states(0, stage)[1]:
                out.update((full_name(name, sum(split[:stage]), self.model), float(optim["state"][i]["step"]))
                           for i, name in enumerate(optim[STATE_NAMES]) if i in optim["state"])
        return out

    def has_main(self) -> bool:
        return any(MAIN_PARAMS in optim for optim in self._states(0, 0)[1])


def _load_resharded(iter_dir: Path, saved: dict[str, Any], policy: Any, optimizer: Any) -> None:
    """Weights and optimizer state saved at layout ``saved``, gathered into their full form and split for
    this rank's (local_state_dict, as a converted checkpoint's weights)."""
    ctx, model = policy.ctx, policy.config
    why = reshard_refusal(saved, training_layout(policy, optimizer))
    if why is not None:
        raise ValueError(f"{iter_dir} was saved in another parallel layout: {why}")
    out = iter_dir.parent
    split = ctx.stage_layers(model.num_layers)
    here = (ctx.tp_size, ctx.tp_rank, ctx.pp_size, ctx.pp_rank, split)
    states = _SavedOptimizer(iter_dir, saved, model)

    def field(name: str) -> dict[str, torch.Tensor]:  # (weights, or one of AdamW's fields) for this rank
        full = MegatronCheckpointReader(out, iteration=iter_dir, shards=lambda t, s: states.part(t, s, name))
        return local_state_dict(full, model, *here)

    policy.load_local_state_dict(field("weights"))
    saved_steps = states.steps()
    steps = {n: saved_steps[f] for n in optimizer.names
             if (f := full_name(n, sum(split[:ctx.pp_rank]), model)) in saved_steps}
    optimizer.load_named_state({k: field(k) for k in ("exp_avg", "exp_avg_sq")}, steps,
                               field("main") if states.has_main() else None)
    rng = iter_dir / shard_dir_name(0, 0, saved["pipeline_model_parallel_size"]) / "model_optim_rng.pt"
    torch.set_rng_state(torch.load(rng, map_location="cpu", weights_only=False, mmap=True)["rng"])
