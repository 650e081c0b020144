"""Inductor's compile workers start with the engine, before the weights load and the profile run, and only for an
engine that compiles (a GPU without ``enforce_eager``): until they are ready inductor compiles every kernel of a
fresh process in the main process, one after another."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.async_compile as async_compile

from paged_backend import LLM
from paged_backend.config import EngineConfig
from paged_backend.worker.compile import start_compile_workers
from tests.conftest import tiny_model


@pytest.mark.parametrize(
    ("device", "settings", "started"),
    [("cuda", {}, True), ("cuda", {"enforce_eager": True}, False), ("cuda", {"batch_invariant": True}, False),
     ("cpu", {}, False)],
)  # fmt: skip
def test_workers_start_only_for_an_engine_that_compiles(
    monkeypatch, device: str, settings: dict, started: bool
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append("warm"))
    start_compile_workers(EngineConfig.from_kwargs("m", **settings), torch.device(device))
    assert calls == (["warm"] if started else [])


def test_workers_that_cannot_start_early_leave_the_start_to_inductor(monkeypatch, caplog) -> None:
    def fail() -> None:
        raise OSError("too many processes")

    monkeypatch.setattr(async_compile, "maybe_warm_pool", fail)
    start_compile_workers(EngineConfig.from_kwargs("m"), torch.device("cuda"))
    assert "could not start inductor's compile workers early (OSError: too many processes)" in caplog.text


def test_the_engine_starts_them_before_loading_the_model(monkeypatch, tokenizer) -> None:
    import paged_backend.engine.engine_setup as engine_setup

    order: list[str] = []
    monkeypatch.setattr(engine_setup, "start_compile_workers", lambda config, device: order.append(device.type))
    load_model = engine_setup.load_model
    monkeypatch.setattr(engine_setup, "load_model", lambda *a, **k: (order.append("load"), load_model(*a, **k))[1])
    LLM(tiny_model("llama"), tokenizer=tokenizer, num_kv_blocks=16, max_model_len=64)
    assert order == ["cpu", "load"]
