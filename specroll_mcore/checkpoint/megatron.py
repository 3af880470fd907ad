"""Megatron checkpoints on disk: the layout Megatron-LM's own tools read, written atomically.

    DIR/
      specroll_config.json              ModelConfig, the TP/PP layout, tokenizer and source info
      latest_checkpointed_iteration.txt "release"
      release/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt   {"model": shard, "checkpoint_version": 3.0}
      tokenizer files (tokenizer.json, tokenizer_config.json, chat template, ...)

A checkpoint is written into a temporary sibling directory and renamed into place when complete
(after fsync), so a crash or kill never leaves a directory that looks whole. Loading at another
TP/PP layout gathers the full form from the shards and reshards it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from specroll_mcore.checkpoint.shard import (_LAYER, expected_full_shapes, local_state_dict, stage_split,
                                             unshard_tensor)
from specroll_mcore.config import ModelConfig

CONFIG_FILE = "specroll_config.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
# A training checkpoint's iteration records the parallel layout it was saved in (a run resumed at another
# layout holds iterations of both): these keys of it are what CONFIG_FILE records for the whole directory.
LAYOUT_FILE = "layout.json"
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "pipeline_stage_layers")


def shard_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Megatron-LM's shard directory name."""
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable (a file created, renamed or removed in it): a
    rename is only as durable as its directory, after a crash of the machine rather than the process.
    A file system that cannot fsync a directory is left to its own guarantees."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path, files: bool = True) -> None:
    """Every file under ``root`` (not with ``files`` False: each fsynced by its writer), then every
    directory, deepest first, and ``root`` itself."""
    paths = sorted(root.rglob("*"))
    for path in paths if files else ():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for path in sorted((p for p in paths if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        fsync_dir(path)
    fsync_dir(root)


def _umask() -> int:
    """This process's umask (read from /proc where it can be, as setting it to read it races with threads
    creating files meanwhile)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def new_file_mode(directory: bool = False) -> int:
    """The permission bits ``open(path, "w")`` (``mkdir``) gives a new file (directory): 0o666 (0o777) less
    the umask. Files written through a temporary and a rename take them on explicitly: ``mkstemp``,
    ``mkdtemp`` and safetensors' writer create theirs private (0o600), which would leave a converted
    model unreadable to the other users of a cluster or to a serving container under another uid."""
    return (0o777 if directory else 0o666) & ~_umask()


def replacement_mode(path: Path) -> int:
    """The permission bits of a file written over ``path``: those it has (as ``open`` keeps them), or a
    new file's."""
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        return new_file_mode()


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` to ``path`` via a temporary file of this process, fsynced, and a rename (readers never
    see half a file, a kill or a crash leaves the old one; processes writing the same file at once, as
    every rank of a run caching its profiles on a shared file system, each replace it whole)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # (an output path in a folder of its own: made, not refused)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            os.fchmod(f.fileno(), replacement_mode(path))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """``obj`` as JSON to ``path`` with :func:`write_text_atomic`."""
    write_text_atomic(path, json.dumps(obj, indent=2, default=float))


def atomic_directory(out_dir: Path, write: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Run ``write(tmp)`` into a temporary sibling of ``out_dir``, fsync it, then rename it into place.
    Its directories and files get the permissions ``mkdir`` and ``open`` give (:func:`new_file_mode`)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists; pass overwrite=True (--overwrite) to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write(tmp)
        modes = {False: new_file_mode(), True: new_file_mode(directory=True)}
        for path in [*tmp.rglob("*"), tmp]:
            path.chmod(modes[path.is_dir()])
        _fsync_tree(tmp)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            fsync_dir(out_dir.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
            fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def write_checkpoint_files(root: Path, full: Mapping[str, torch.Tensor], model: ModelConfig, tp_size: int,
                           pp_size: int, extra_config: Optional[dict[str, Any]] = None,
                           stage_layers: Optional[Sequence[int]] = None) -> None:
    """Write every TP/PP shard of ``full`` (a mapping that may compute tensors lazily) into ``root``
    (``stage_layers``: layers per pipeline stage; None: an even split).

    One shard is built and saved at a time: peak memory is about one shard plus one full tensor.
    """
    release = root / "release"
    split = stage_split(model, pp_size, stage_layers)
    for pp_rank in range(pp_size):
        for tp_rank in range(tp_size):
            shard = local_state_dict(full, model, tp_size, tp_rank, pp_size, pp_rank, split)
            d = release / shard_dir_name(tp_rank, pp_rank, pp_size)
            d.mkdir(parents=True)
            torch.save({"model": {k: v.contiguous() for k, v in shard.items()},
                        "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0},
                       d / "model_optim_rng.pt")
            del shard
    (root / TRACKER_FILE).write_text("release")
    meta = {"model": model.to_dict(), "tensor_model_parallel_size": tp_size,
            "pipeline_model_parallel_size": pp_size, "pipeline_stage_layers": split,
            "policy_fingerprint": fingerprint(full),
            **(extra_config or {})}
    (root / CONFIG_FILE).write_text(json.dumps(meta, indent=2))


def fingerprint(full: Mapping[str, torch.Tensor], samples: int = 4096) -> str:
    """Identity of a set of policy weights (full form), independent of the TP/PP layout: a hash of
    each tensor's name, shape and an evenly strided sample of its values. Heads record the
    fingerprint of the policy they were fitted on."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(full):
        t = full[name]
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(flat[::step].to(torch.float64).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


HEADS_FILE = "heads.pt"


def heads_path(ckpt_dir: Path) -> Path:
    """Where a checkpoint's heads live: ``heads.pt`` beside a converted checkpoint; in a GRPO run's output
    directory, in its latest iteration, beside the weights they go with (the run's own config names the
    weights it started from, not those)."""
    ckpt_dir = Path(ckpt_dir)
    latest = iteration_dir(ckpt_dir) if (ckpt_dir / TRACKER_FILE).is_file() else None
    return latest / HEADS_FILE if latest is not None and latest.name != "release" else ckpt_dir / HEADS_FILE


def save_heads(ckpt_dir: Path, heads: Mapping[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write unsharded head weights where :func:`load_heads` reads them (:func:`heads_path`), atomically
    (temp file, fsync, rename); beside a converted checkpoint they record the policy fingerprint they
    were fitted on."""
    ckpt_dir = Path(ckpt_dir)
    path = heads_path(ckpt_dir)
    if path.parent == ckpt_dir:
        meta = {**meta, "fitted_on": read_checkpoint_config(ckpt_dir).get("policy_fingerprint")}
    save_atomic({"heads": {k: v.detach().cpu() for k, v in heads.items()}, "meta": dict(meta)}, path)
    return path


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, rename: a crash or kill leaves the
    old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, replacement_mode(path))
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_heads(ckpt_dir: Path, allow_stale: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Head weights saved with :func:`save_heads`: in a GRPO run's output directory those of its latest
    checkpoint (saved with that iteration's weights: the heads the trainer had adapted to them, or
    tools/train_heads.py's since), else those beside the checkpoint. Heads fitted on other policy weights
    are refused unless ``allow_stale`` (they still give exact tokens, but their acceptance collapses)."""
    ckpt_dir = Path(ckpt_dir)
    path = heads_path(ckpt_dir)
    if path.parent != ckpt_dir and path.is_file():
        blob = torch.load(path, map_location="cpu", weights_only=True)
        return blob["heads"], blob["meta"]
    if not (ckpt_dir / HEADS_FILE).is_file():
        raise FileNotFoundError(f"{path} does not exist: train heads with tools/train_heads.py first")
    path = ckpt_dir / HEADS_FILE
    blob = torch.load(path, map_location="cpu", weights_only=True)
    current = read_checkpoint_config(ckpt_dir).get("policy_fingerprint")
    if blob["meta"].get("fitted_on") != current and not allow_stale:
        raise ValueError(f"heads in {path} were fitted on policy {blob['meta'].get('fitted_on')}, the checkpoint "
                         f"holds policy {current}: retrain or consolidate them (or pass allow_stale=True)")
    return blob["heads"], blob["meta"]


def iteration_layout(iter_dir: Path) -> Optional[dict[str, Any]]:
    """The parallel layout a training checkpoint's iteration was saved in (None: an iteration written
    before they were recorded, or a converted checkpoint, whose layout is its CONFIG_FILE's)."""
    path = Path(iter_dir) / LAYOUT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def read_checkpoint_config(ckpt_dir: Path, iteration: Optional[Path] = None) -> dict[str, Any]:
    """CONFIG_FILE, with the TP/PP layout of the iteration the shards are read from (``iteration``, or
    the one the tracker points at): a run resumed at another layout records the new one in CONFIG_FILE
    when it starts, before its first checkpoint in that layout."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt_dir} is not a specroll Megatron checkpoint: {CONFIG_FILE} is missing "
                                f"(convert a Hugging Face model with `specroll convert`)")
    meta = json.loads(path.read_text())
    if iteration is None and (ckpt_dir / TRACKER_FILE).is_file():
        iteration = iteration_dir(ckpt_dir)
    layout = iteration_layout(iteration) if iteration is not None else None
    if layout is not None:
        meta.update({k: layout[k] for k in LAYOUT_KEYS})
    return meta


def stop_token_ids(ckpt_dir: Path, tokenizer: Any) -> list[int]:
    """The token ids that end a response: the tokenizer's EOS and every ``eos_token_id`` of the
    checkpoint's ``generation_config.json`` (the converter copies it from the Hugging Face model), the
    ids ``transformers`` ``generate`` and vLLM stop at. An instruct model's generation config often
    names more than its tokenizer does (Llama 3.1: end of turn, end of message and end of text)."""
    ids = set() if getattr(tokenizer, "eos_token_id", None) is None else {int(tokenizer.eos_token_id)}
    path = Path(ckpt_dir) / "generation_config.json"
    if path.is_file():
        try:
            listed = json.loads(path.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{path} is not a JSON object ({e}); fix or delete it (the tokenizer's EOS is "
                             f"used without it)") from e
        listed = [] if listed is None else listed if isinstance(listed, list) else [listed]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in listed):
            raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {listed!r}")
        ids.update(listed)
    return sorted(ids)


def model_config_of(ckpt_dir: Path, params_dtype: Optional[str] = None,
                    overrides: Optional[dict[str, Any]] = None) -> ModelConfig:
    """The checkpoint's ModelConfig, with ``params_dtype`` and ``overrides`` (fields) in place of its own."""
    d = dict(read_checkpoint_config(ckpt_dir)["model"])
    if params_dtype:
        d["params_dtype"] = params_dtype
    d.update(overrides or {})
    return ModelConfig.from_dict(d)


def iteration_name(step: int) -> str:
    """A training iteration's directory name (Megatron-LM's ``iter_NNNNNNN``)."""
    return f"iter_{step:07d}"


def iteration_dir(ckpt_dir: Path) -> Path:
    """The directory the tracker file points at: ``release`` or ``iter_NNNNNNN`` (Megatron-LM's rule)."""
    tracker = Path(ckpt_dir) / TRACKER_FILE
    if not tracker.is_file():
        raise FileNotFoundError(f"{tracker} is missing: {ckpt_dir} holds no complete checkpoint")
    it = tracker.read_text().strip()
    return Path(ckpt_dir) / ("release" if it == "release" else iteration_name(int(it)))


def saved_iteration(ckpt_dir: Path, iteration: int) -> Path:
    """The directory of training iteration ``iteration`` of a run (one its ``keep_last`` kept)."""
    d = Path(ckpt_dir) / iteration_name(iteration)
    if not d.is_dir():
        held = sorted(int(p.name[5:]) for p in Path(ckpt_dir).glob("iter_*") if p.name[5:].isdigit() and p.is_dir())
        raise FileNotFoundError(f"{ckpt_dir} holds no iteration {iteration}; it holds "
                                f"{', '.join(map(str, held)) if held else 'none'} (TrainConfig.keep_last keeps the "
                                "last ones)")
    return d


def _load_shard(iteration: Path, tp_rank: int, pp_rank: int, pp_size: int, mmap: bool = False
                ) -> dict[str, torch.Tensor]:
    path = iteration / shard_dir_name(tp_rank, pp_rank, pp_size) / "model_optim_rng.pt"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint shard {path} is missing; the checkpoint is incomplete")
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)["model"]


class MegatronCheckpointReader(Mapping[str, torch.Tensor]):
    """The full (unsharded, unpadded) form of a Megatron checkpoint of any TP/PP layout, tensor by
    tensor on access, each checked against the shape its config implies. One pipeline stage's TP
    shards are open at a time (the names are in stage order: embedding, layers, final norm, output
    layer), memory-mapped with ``mmap``: reading a large checkpoint in order never holds it whole in
    memory (the export to HF, checkpoint/convert.py)."""

    def __init__(self, ckpt_dir: Path, mmap: bool = True, iteration: Optional[Path] = None,
                 shards: Optional[Callable[[int, int], Mapping[str, torch.Tensor]]] = None) -> None:
        """``iteration``: the iteration to read (default: the tracker's); ``shards(tp_rank, stage)``: the
        tensors of one saved rank under their local names, in place of its weights (the optimizer state
        of a training checkpoint, checkpoint/train_state.py)."""
        self.ckpt_dir, self.mmap = Path(ckpt_dir), mmap
        self.meta = read_checkpoint_config(self.ckpt_dir, iteration)
        self.iteration = Path(iteration) if iteration is not None else iteration_dir(self.ckpt_dir)
        self._read = shards or (lambda tp_rank, stage: _load_shard(self.iteration, tp_rank, stage, self.pp,
                                                                     self.mmap))
        self.model = ModelConfig.from_dict(self.meta["model"])
        self.tp, self.pp = self.meta["tensor_model_parallel_size"], self.meta["pipeline_model_parallel_size"]
        self._shapes = expected_full_shapes(self.model)
        self._split = stage_layers_of(self.meta, self.model)
        if len(self._split) != self.pp or sum(self._split) != self.model.num_layers:
            raise ValueError(f"{self.ckpt_dir}: {CONFIG_FILE} gives the model num_layers={self.model.num_layers} but "
                             f"records its pipeline stages holding {self._split} layers; does it belong to these "
                             f"weights?")
        starts = [0]
        for n in self._split:
            starts.append(starts[-1] + n)
        self._where: dict[str, tuple[int, str, str]] = {}  # full name -> (stage, local name, unsharding key)
        for name in self._shapes:
            m = _LAYER.match(name)
            if m:
                layer = int(m.group(1))
                stage = next(i for i in range(self.pp) if layer < starts[i + 1])
                self._where[name] = (stage, f"decoder.layers.{layer - starts[stage]}.{m.group(2)}", m.group(2))
            else:
                self._where[name] = (0 if name.startswith("embedding.") else self.pp - 1, name, name)
        self._stage: Optional[int] = None
        self._shards: list[dict[str, torch.Tensor]] = []

    def __iter__(self):
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def __contains__(self, name: object) -> bool:  # (without reading the tensor)
        return name in self._shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        stage, local, key = self._where[name]
        if stage != self._stage:
            self._shards = []  # (the previous stage's mappings go once their tensors do)
            self._shards = [self._read(t, stage) for t in range(self.tp)]
            self._stage = stage
            held = sorted({int(m.group(1)) for k in self._shards[0] if (m := _LAYER.match(k))})
            if held != list(range(self._split[stage])):
                raise ValueError(f"checkpoint {self.ckpt_dir}: the shards of pipeline stage {stage} hold {len(held)} "
                                 f"layers, {CONFIG_FILE} gives that stage {self._split[stage]}; does it belong to "
                                 f"these weights?")
        if any(local not in shard for shard in self._shards):
            raise ValueError(f"checkpoint {self.ckpt_dir} lacks {name} (stage {stage}: {local})")
        full = unshard_tensor(key, [shard[local] for shard in self._shards], self.model)
        if tuple(full.shape) != self._shapes[name]:
            raise ValueError(f"{name} has shape {tuple(full.shape)} but the model config implies "
                             f"{self._shapes[name]}; does {CONFIG_FILE} belong to these weights?")
        return full


def load_full_state_dict(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Gather the full (unsharded, unpadded) form from all shards of a checkpoint, in memory."""
    return dict(MegatronCheckpointReader(Path(ckpt_dir), mmap=False).items())


def stage_layers_of(meta: dict[str, Any], model: ModelConfig) -> list[int]:
    """Layers per pipeline stage of a checkpoint (one written before uneven splits: even)."""
    return stage_split(model, meta["pipeline_model_parallel_size"], meta.get("pipeline_stage_layers"))


def load_local_state_dict(ckpt_dir: Path, model: ModelConfig, tp_size: int, tp_rank: int, pp_size: int,
                          pp_rank: int, stage_layers: Optional[Sequence[int]] = None
                          ) -> Optional[dict[str, torch.Tensor]]:
    """This rank's shard read directly when the layouts (TP, PP and the layers per stage; None: an
    even split) match, else None (reshard from the full form)."""
    meta = read_checkpoint_config(ckpt_dir)
    if (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]) != (tp_size, pp_size):
        return None
    if stage_layers_of(meta, model) != stage_split(model, pp_size, stage_layers):
        return None
    if model.padded_vocab_size(tp_size) != ModelConfig.from_dict(meta["model"]).padded_vocab_size(tp_size):
        return None
    return _load_shard(iteration_dir(ckpt_dir), tp_rank, pp_rank, pp_size)


def load_policy(ckpt_dir: Path, ctx: Any, params_dtype: Optional[str] = None, num_heads: int = 0,
                with_heads: bool = False, overrides: Optional[dict[str, Any]] = None) -> Any:
    """Build the policy for this rank's layout and load a checkpoint into it (resharding if the
    checkpoint was written for another TP/PP layout). ``with_heads`` also loads the saved horizon
    heads (their count comes from the file); otherwise ``num_heads`` fresh zero-initialised heads.
    ``overrides``: ModelConfig fields that do not change the weights (a training setting such as
    ``moe_aux_loss_coeff``)."""
    from specroll_mcore.model import PolicyModel

    model = model_config_of(ckpt_dir, params_dtype, overrides)
    heads = None
    if with_heads:
        heads, meta = load_heads(ckpt_dir)
        num_heads = int(meta["num_heads"])
    policy = PolicyModel(model, ctx, num_heads=num_heads).eval()
    if heads is not None:
        policy.load_full_heads(heads)
    local = load_local_state_dict(ckpt_dir, model, ctx.tp_size, ctx.tp_rank, ctx.pp_size, ctx.pp_rank,
                                  ctx.stage_layers(model.num_layers))
    if local is None:
        policy.load_full_state_dict({k: v.to(model.torch_dtype) for k, v in load_full_state_dict(ckpt_dir).items()})
    else:
        policy.load_local_state_dict({k: v.to(model.torch_dtype) for k, v in local.items()})
    return policy
