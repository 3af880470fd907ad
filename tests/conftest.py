import atexit
import importlib
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

# Tests write caches (capacity profiles, converted models) into a private directory, never the user's.
os.environ["SPECROLL_CACHE"] = tempfile.mkdtemp(prefix="specroll-test-cache-")
atexit.register(shutil.rmtree, os.environ["SPECROLL_CACHE"], ignore_errors=True)

warnings.filterwarnings("ignore", category=UserWarning)

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint import random_full_state_dict  # noqa: E402
from specroll_mcore.config import ModelConfig, ParallelConfig  # noqa: E402
from specroll_mcore.model import PolicyModel  # noqa: E402


@pytest.fixture(scope="session")
def ctx():
    """One process, TP=1, PP=1 (megatron's parallel state is global: set once per session)."""
    c = parallel.initialize(ParallelConfig())
    yield c


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """SmolLM2 converted once per session, into the tests' private cache (~25 s). Tests that write
    beside it (heads) work on a copy."""
    from specroll_mcore.checkpoint.smollm2 import default_checkpoint

    return default_checkpoint()


def make_policy(cfg: ModelConfig, ctx, seed: int = 0) -> PolicyModel:
    """A policy with seeded random weights given in the full form (layout independent)."""
    model = PolicyModel(cfg, ctx).eval()
    model.load_full_state_dict(random_full_state_dict(cfg, seed, std=0.08))
    return model


def import_tool(name: str):
    """A script of tools/ as a module (the folder is not a package)."""
    tools = str(Path(__file__).resolve().parent.parent / "tools")
    sys.path.insert(0, tools)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(tools)
