"""Build an instance's engine from its config: model, KV pool, radix cache, engine."""

from __future__ import annotations

import torch

from shared.config import ClusterConfig, InstanceConfig
from shared.model_info import model_path
from shared.runtime.engine import Engine
from shared.runtime.grammar import Grammars
from shared.runtime.kv_pool import KVPool
from shared.runtime.models import kv_layout, load_model, load_tokenizer, parse_dtype
from shared.runtime.provision import provision_default_model
from shared.runtime.radix_cache import RadixCache
from shared.runtime.runner import ModelRunner
from shared.security import Secrets


def build_engine(cfg: ClusterConfig, inst: InstanceConfig) -> Engine:
    """The instance's model, KV pool and engine, as its config says. Built with the engine's
    thread count (the caller's is restored): the runner times its small-step kernels on the
    weights as the engine thread will run them (shared/runtime/fused.py)."""
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads_of(inst))
    try:
        return _build(cfg, inst)
    finally:
        torch.set_num_threads(caller_threads)


def _build(cfg: ClusterConfig, inst: InstanceConfig) -> Engine:
    path = provision_default_model() if cfg.model == "default" else model_path(cfg.model)
    model = load_model(path, dtype=inst.dtype, device=cfg.device or inst.device)
    tokenizer = load_tokenizer(path)  # stop strings are checked on decoded text
    pool = KVPool.with_capacity(
        kv_layout(model),
        tokens=inst.kv_tokens,
        block_size=cfg.block_size,
        dtype=parse_dtype(inst.dtype),
        device=next(model.parameters()).device,  # on a GPU: CUDA-graph decode steps (shared/runtime/runner.py)
    )
    eos = model.generation_config.eos_token_id
    eos_ids = tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()
    return Engine(
        ModelRunner(model, pool, invariant=None if inst.batch_invariant else False),
        max_step_tokens=cfg.step_tokens_of(inst),
        max_running=inst.max_running,
        eos_token_ids=eos_ids,
        decode_text=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        cache=RadixCache(pool.allocator, pool.block_size, _index_key(cfg)) if inst.prefix_cache else None,
        namespace=cfg.model,  # the scheduler hashes prompts in the same namespace
        grammars=Grammars(path / "tokenizer.json", model.config.vocab_size, eos_ids),
    )


def _index_key(cfg: ClusterConfig) -> bytes:
    secrets = Secrets.of(cfg)
    return secrets.index_key if secrets else b""
