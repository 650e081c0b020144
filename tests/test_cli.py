"""``paged-backend serve`` behaves as ``vllm serve``: help without a model, the model as ``MODEL`` or ``--model``,
and a missing extra or a bad model path is one line and a non-zero exit, not a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from paged_backend.entrypoints.cli import main
from tests.conftest import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
SERVE = [sys.executable, "-m", "paged_backend.entrypoints.cli", "serve"]
MODULE = [sys.executable, "-m", "paged_backend.entrypoints.openai.api_server"]


def run(command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def served(monkeypatch) -> list[tuple]:
    """``run``'s arguments in place of loading a model and serving it."""
    api_server = pytest.importorskip("paged_backend.entrypoints.openai.api_server")
    calls: list[tuple] = []
    monkeypatch.setattr(api_server, "run", lambda args, engine, prog="": calls.append((args, engine, prog)) or 0)
    return calls


def test_serve_help_needs_no_model(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("MODEL", "--model", "--block-size", "--max-num-seqs", "--served-model-name", "--api-key"):
        assert flag in text, flag


def test_serve_help_from_the_command_line() -> None:
    result = run([*SERVE, "--help"])
    assert result.returncode == 0 and "--max-model-len" in result.stdout and "--model" in result.stdout


@pytest.mark.parametrize(
    "argv",
    [["M"], ["--model", "M"], ["--block-size", "8", "M"], ["M", "--block-size", "8"], ["M", "--model", "M"]],
)
def test_model_as_positional_or_flag(argv: list[str], served: list[tuple]) -> None:
    assert main(["serve", *argv]) == 0
    (args, engine, prog), *_ = served
    assert args.model == "M" and prog == "paged-backend serve"
    assert engine == ({"block_size": 8} if "--block-size" in argv else {})


def test_two_different_models_are_an_error_naming_both(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "A", "--model", "B"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "'A'" in err and "--model 'B'" in err


def test_no_model_is_an_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "8001"])
    assert exit_info.value.code == 2 and "a model is required" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["fastapi", "uvicorn"])
def test_a_missing_extra_is_one_line_naming_it(module: str) -> None:
    code = (
        f"import sys; sys.modules[{module!r}] = None  # as if the [server] extra were not installed\n"
        "from paged_backend.entrypoints.cli import main\n"
        "sys.exit(main(['serve', 'M']))\n"
    )
    result = run([sys.executable, "-c", code])
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"paged-backend serve: {module} is not installed; the server needs the [server] extra: "
        "pip install 'paged-backend[server]'"
    ]


def test_the_module_path_without_the_extra_is_one_line() -> None:
    code = (
        "import runpy, sys; sys.modules['fastapi'] = None\n"
        "sys.argv = ['api_server', '--model', 'M']\n"
        "runpy.run_module('paged_backend.entrypoints.openai.api_server', run_name='__main__')\n"
    )
    result = run([sys.executable, "-c", code])
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "python -m paged_backend.entrypoints.openai.api_server: fastapi is not installed; the server needs the "
        "[server] extra: pip install 'paged-backend[server]'"
    ]


def test_help_works_without_the_extra() -> None:
    code = (
        "import sys; sys.modules['fastapi'] = None\n"
        "from paged_backend.entrypoints.cli import main\n"
        "sys.exit(main(['serve', '--help']))\n"
    )
    result = run([sys.executable, "-c", code])
    assert result.returncode == 0 and "--block-size" in result.stdout


def test_a_bad_model_path_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    missing = tmp_path / "no-such-model"
    result = run([*SERVE, str(missing)])
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.strip()] == [
        f"paged-backend serve: cannot load the model {str(missing)!r}: no such file or folder"
    ]


def test_a_missing_path_is_refused_before_the_heavy_imports(tmp_path: Path) -> None:
    """The check needs neither torch nor transformers: a mistyped path is said before they load."""
    code = (
        "import sys\nfrom paged_backend.entrypoints.cli import main\n"
        "try:\n    main(['serve', sys.argv[1], '--port', '1'])\n"
        "except SystemExit as exc:\n    print(exc.code)\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    for missing in (tmp_path / "no-such-model", tmp_path / "model.gguf"):
        result = run([sys.executable, "-c", code, str(missing)])
        assert result.stdout.splitlines() == [
            f"paged-backend serve: cannot load the model {str(missing)!r}: no such file or folder",
            "[]",
        ], result.stderr


def test_flags_are_never_abbreviated(capsys) -> None:
    from paged_backend.entrypoints.openai.cli_args import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["M", "--max-num-seq", "4"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --max-num-seq" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--num-prompt", "2"])
    assert "unrecognized arguments: --num-prompt" in capsys.readouterr().err


def test_a_busy_port_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    model = tmp_path / "model"
    save_tiny_checkpoint(model)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run([*SERVE, str(model), "--port", str(port)])
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"paged-backend serve: cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "KV cache" not in result.stderr  # the engine was never built


def test_a_folder_without_a_checkpoint_is_one_line(tmp_path: Path) -> None:
    api_server = pytest.importorskip("paged_backend.entrypoints.openai.api_server")
    with pytest.raises(SystemExit) as exit_info:  # Python prints its message as the one line on stderr, exit 1
        api_server.main(["--model", str(tmp_path)])
    message = str(exit_info.value.code)
    assert message.startswith(
        f"python -m paged_backend.entrypoints.openai.api_server: cannot load the model {str(tmp_path)!r}: "
    )
    assert "\n" not in message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_module_path_serves_with_model_flag(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    model = tmp_path / "model"
    save_tiny_checkpoint(model)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    command = [*MODULE, "--model", str(model), "--port", str(port), "--max-model-len", "128"]
    log = tmp_path / "server.log"
    with log.open("w") as sink:
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        models = None
        give_up = time.monotonic() + 300  # only stops a server that never answers; a working one answers at once
        while models is None and time.monotonic() < give_up:
            if server.poll() is not None:
                pytest.fail(f"the server exited {server.returncode}: {log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as response:
                    models = response.read().decode()
            except OSError:
                time.sleep(0.2)  # still loading
        assert models is not None, log.read_text()[-3000:]
        # a local path is served by its folder's name, never the path itself
        assert [m["id"] for m in json.loads(models)["data"]] == ["model"] and str(model) not in models
    finally:
        server.terminate()
        server.wait(timeout=60)
