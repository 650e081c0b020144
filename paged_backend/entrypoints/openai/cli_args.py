"""The OpenAI server's command line, with vLLM's flag names, so that a vLLM serving command's flags
(``M --block-size 16 --swap-space 4 --max-num-seqs 256``, the model as ``M`` or ``--model M``) carry over
unchanged.

Engine flags map one to one onto ``LLM(...)`` keyword arguments (and are validated there); the rest configure
the server itself (``ServerArgs``).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import Any

from paged_backend.config import SpeculativeConfig
from paged_backend.entrypoints.data_parallel.config import DataParallelConfig
from paged_backend.entrypoints.openai.cli_data_parallel import add_data_parallel_flags, data_parallel_config
from paged_backend.paths import missing_local_model
from paged_backend.structured_output.grammar_budget import GrammarBudget
from paged_backend.tool_calls.parsers import TOOL_CALL_PARSERS

API_KEY_ENV = "PAGED_BACKEND_API_KEY"
# The body cap: far above any body that fits a context (128k tokens of text is ~1 MB of JSON, as token ids ~1 MB;
# a batch of dozens of such prompts fits), while one request's JSON, its parsed copy and its validated copy stay
# within a small multiple of it.
DEFAULT_MAX_REQUEST_BODY_MB = 32.0
DEFAULT_MAX_LOGPROB_ENTRIES = 1 << 20  # about 50 MB of JSON

# (flag, type, help): each flag's name with underscores is its LLM keyword; defaults are the engine's own, but the
# server's token budget and decode steps a round (launch.SERVER_MAX_NUM_BATCHED_TOKENS, SERVER_NUM_SCHEDULER_STEPS).
_ENGINE_FLAGS: list[tuple[str, type, str]] = [
    ("--block-size", int, "tokens per KV block (default 16)"),
    ("--swap-space", float, "GiB of pinned CPU memory for swapped-out blocks (default 4, 0 where none can preempt)"),
    ("--max-num-seqs", int, "sequences per step (default 256)"),
    ("--max-num-batched-tokens", int, "tokens per step (default 384 or --max-num-seqs in the server; LLM's is 8192)"),
    ("--max-model-len", int, "context limit (default: the model's)"),
    ("--gpu-memory-utilization", float, "share of GPU memory to use (default 0.9)"),
    (
        "--kv-cache-memory-gib",
        float,
        "GiB of KV cache off a GPU (default 1; on a GPU --gpu-memory-utilization sizes it)",
    ),
    ("--num-kv-blocks", int, "KV cache size in blocks, instead of sizing it by memory"),
    ("--kv-cache-dtype", str, "auto (the model's dtype), fp8 or fp8_e4m3 (float8_e4m3fn: twice the tokens)"),
    ("--tensor-parallel-size", int, "GPUs to shard the model over (default 1)"),
    ("--dtype", str, "auto, float32, float16, bfloat16 (default auto)"),
    ("--quantization", str, "awq, gptq, compressed-tensors, fp8 (the checkpoint's, found by itself; fp8 also at load)"),
    ("--max-loras", int, "LoRA adapters in one batch (default 4)"),
    ("--max-lora-rank", int, "largest LoRA rank (default 16)"),
    ("--seed", int, "seed of unseeded sampling (default 0)"),
    ("--long-prefill-token-threshold", int, "prompt tokens of one request per step, 0: no cap (default 0)"),
    ("--logprobs-mode", str, "raw_logprobs (the model's, default) or processed_logprobs (the sampled distribution's)"),
    ("--num-scheduler-steps", int, "greedy decode steps per scheduling round (default 2 here, 8 in LLM)"),
    ("--preemption-mode", str, "swap or recompute (default: swap on a GPU with swap space, where it can preempt)"),
    ("--device", str, "auto, cpu, cuda or cuda:N (default auto)"),
    ("--load-format", str, "auto (the checkpoint) or dummy (random weights from config.json, for benchmarks)"),
]


# Output grammars (structured outputs, forced tool calls): caps checked before a compile, and the compile workers
_GRAMMAR_FLAGS: list[tuple[str, str, type, str]] = [
    ("--max-grammar-bytes", "max_bytes", int, "a larger schema, pattern or grammar gets a 400 before it compiles"),
    ("--max-grammar-choices", "max_choices", int, "more enum or choice values get a 400 before they compile"),
    ("--max-grammar-regex-length", "max_regex_length", int, "a longer regex gets a 400 before it compiles"),
    ("--grammar-compile-timeout", "compile_timeout_s", float, "seconds a compile may take; then it is killed and "
     "its request gets a 400"),
    ("--grammar-compile-workers", "compile_workers", int, "compile processes, each on one core at low priority"),
    ("--max-queued-grammar-compiles", "max_queued_compiles", int, "compiles that may wait for a worker; more get "
     "429"),
]  # fmt: skip


@dataclass(frozen=True)
class ServerArgs:
    """What the server needs besides the engine's arguments."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    chat_template: str | None = None
    reasoning_parser: str | None = None  # deepseek_r1 or qwen3: <think>...</think> into reasoning_content
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model decides, tool_call_parser reads its text
    tool_call_parser: str | None = None  # hermes, llama3_json or mistral
    max_waiting_requests: int | None = None
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> adapter path
    max_request_body_mb: float = DEFAULT_MAX_REQUEST_BODY_MB
    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES  # per request: tokens x (alternatives + 1)
    header_read_timeout: float = 20.0  # seconds for a request's whole header block: 408, connection closed
    body_read_timeout: float = 30.0  # seconds without a request body's next bytes: 408
    timeout_keep_alive: int = 5  # uvicorn's: an idle connection closes after this long (vLLM's default)
    shutdown_timeout: float = 0.0  # seconds in-flight requests get after SIGTERM / SIGINT (vLLM's default: none)
    grammar_budget: GrammarBudget = field(default_factory=GrammarBudget)  # caps and compile budget of grammars
    data_parallel: DataParallelConfig | None = None  # --data-parallel-size N > 1: N replicas on Ray

    @property
    def model_name(self) -> str:
        """The name clients use in ``model`` (and ``/v1/models`` and the metrics' labels show):
        ``--served-model-name``, else the folder's name when the model is a local path (the path itself would
        tell every client the server's filesystem layout), else the hub id as given. Requests may still name the
        model as ``--model`` gave it, as vLLM's clients do."""
        if self.served_model_name:
            return self.served_model_name
        path = os.path.expanduser(self.model)
        if os.path.isabs(self.model) or self.model.startswith(("./", "../", "~")) or os.path.exists(path):
            return os.path.basename(os.path.abspath(path)) or self.model
        return self.model


def _lora_module(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=path pairs, got {value!r}")
    return name, path


def make_parser(prog: str = "paged-backend serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,  # --max-num-seq must not pass for --max-num-seqs
        usage="%(prog)s [MODEL | --model MODEL] [flags]",
        description="OpenAI-compatible server over the paged engine (vLLM's flag names).",
        epilog=f"The API key may also come from the {API_KEY_ENV} environment variable. "
        "Use --host 0.0.0.0 to accept connections from other machines.",
    )
    # vLLM's two spellings: ``vllm serve MODEL`` and ``--model MODEL``; neither is argparse-required, so that
    # ``--help`` works without a model (parse_args checks that exactly one model was given).
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="model path or hub id")
    parser.add_argument("--model", default=None, help="model path or hub id (the same as MODEL)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path or hub id (default: the model's)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    for flag, kind, text in _ENGINE_FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=text)
    parser.add_argument(
        "--speculative-config",
        type=json_dict,
        default=None,
        metavar="JSON",
        help='vLLM\'s: speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse KV blocks of shared prompt prefixes (default on)",
    )
    parser.add_argument("--enforce-eager", action="store_true", default=None, help="no torch.compile, no CUDA graphs")
    parser.add_argument(
        "--calculate-kv-scales",
        action="store_true",
        default=None,
        help="fp8 KV cache: scales from the first step's keys and values (default: 1.0)",
    )
    parser.add_argument("--enable-lora", action="store_true", default=None, help="serve LoRA adapters")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="queue the next decode round before reading this one's tokens (default: on for one GPU)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        default=None,
        help="a request's output independent of its batch (fixed-order kernels; on a CPU a row at a time)",
    )
    parser.add_argument(
        "--disable-custom-all-reduce",
        action="store_true",
        default=None,
        help="tensor parallelism: NCCL for every all-reduce (default: symmetric memory on GPUs where it works)",
    )
    parser.add_argument(
        "--lora-modules", type=_lora_module, nargs="+", default=[], metavar="NAME=PATH", help="adapters to serve"
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: a local --model's folder name, else the hub id)",
    )
    parser.add_argument("--api-key", default=None, help=f"required bearer token (or ${API_KEY_ENV})")
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["deepseek_r1", "qwen3"],
        help="a thinking model's <think>...</think> goes to reasoning_content, and a requested output format holds "
        "only after it (vLLM's parsers of these names)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="tool_choice 'auto' (the default with tools): the model decides whether to call; needs --tool-call-parser",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(TOOL_CALL_PARSERS),
        help="how the model writes tool calls: hermes (Hermes, Qwen), llama3_json (Llama 3.1+), mistral",
    )
    parser.add_argument(
        "--max-waiting-requests", type=int, default=None, help="queue length beyond which requests get 429"
    )
    parser.add_argument(
        "--max-request-body-mb",
        type=float,
        default=DEFAULT_MAX_REQUEST_BODY_MB,
        metavar="MIB",
        help=f"larger request bodies get 413, refused before they are read (default {DEFAULT_MAX_REQUEST_BODY_MB:g})",
    )
    parser.add_argument(
        "--max-logprob-entries",
        type=int,
        default=DEFAULT_MAX_LOGPROB_ENTRIES,
        metavar="N",
        help="a request whose logprobs or prompt_logprobs could return more entries (tokens x alternatives) gets 400 "
        f"before any work (default {DEFAULT_MAX_LOGPROB_ENTRIES})",
    )
    parser.add_argument(
        "--header-read-timeout",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="a request whose headers take longer (from the connection's start, or the previous response's end) "
        "gets 408 and its connection closes (default 20)",
    )
    parser.add_argument(
        "--body-read-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a request body whose next bytes take longer gets 408 (default 30)",
    )
    parser.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=5,
        metavar="SECONDS",
        help="close a connection idle this long between requests (default 5, as vLLM)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, stop accepting requests and give those in flight this long to finish, then abort "
        "the rest (default 0: abort at once); a second signal stops at once",
    )
    budget = GrammarBudget()
    for flag, name, kind, text in _GRAMMAR_FLAGS:
        parser.add_argument(flag, type=kind, default=getattr(budget, name), dest=f"grammar_{name}",
                            help=f"{text} (default {getattr(budget, name):g})")  # fmt: skip
    add_data_parallel_flags(parser)
    parser.add_argument(
        "--worker-use-ray",
        action="store_true",
        help="run tensor-parallel workers as Ray tasks on the running Ray cluster",
    )
    return parser


def parse_args(argv: list[str] | None = None, prog: str = "paged-backend serve") -> tuple[ServerArgs, dict[str, Any]]:
    """(server arguments, ``LLM`` keyword arguments) from a command line; exits with a message on bad flags."""
    parser = make_parser(prog)
    # intermixed: the optional MODEL may come after flags on every Python the package supports
    args = parser.parse_intermixed_args(argv)
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        parser.error(f"the model is given twice, as MODEL {args.model_tag!r} and as --model {args.model!r}: give one")
    model = args.model or args.model_tag
    if not model:
        parser.error("a model is required: MODEL or --model MODEL (a path or hub id)")
    if missing_local_model(model):  # said now, not after the seconds that torch and transformers take to import
        raise SystemExit(f"{prog}: cannot load the model {model!r}: no such file or folder")
    names = [flag[2:].replace("-", "_") for flag, *_ in _ENGINE_FLAGS]
    names += [
        "enable_prefix_caching",
        "enforce_eager",
        "calculate_kv_scales",
        "enable_lora",
        "async_scheduling",
        "batch_invariant",
        "disable_custom_all_reduce",
    ]
    engine: dict[str, Any] = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.speculative_config is not None:
        try:  # checked now: a bad key is this flag's error, not the model's
            SpeculativeConfig.of(args.speculative_config)
        except ValueError as exc:
            parser.error(f"--speculative-config: {exc}")
        engine["speculative_config"] = args.speculative_config
    if args.tokenizer is not None:
        engine["tokenizer"] = args.tokenizer
    if args.reasoning_parser is not None:  # the server splits the thinking off; the engine starts grammars after it
        engine["reasoning_parser"] = args.reasoning_parser
    if args.worker_use_ray:
        engine["distributed_executor_backend"] = "ray"
    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        parser.error(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if not 0 < args.max_request_body_mb < float("inf"):
        parser.error(f"--max-request-body-mb must be a number of MiB > 0, got {args.max_request_body_mb}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error(
            "--enable-auto-tool-choice needs --tool-call-parser (one of: " + ", ".join(TOOL_CALL_PARSERS) + ")"
        )
    for flag in ("header_read_timeout", "body_read_timeout", "timeout_keep_alive"):
        if not 0 < getattr(args, flag) < float("inf"):
            parser.error(f"--{flag.replace('_', '-')} must be a number of seconds > 0, got {getattr(args, flag)}")
    if args.max_logprob_entries < 1:
        parser.error(f"--max-logprob-entries must be >= 1, got {args.max_logprob_entries}")
    if not 0 <= args.shutdown_timeout < float("inf"):
        parser.error(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout}")
    try:
        budget = GrammarBudget(**{name: getattr(args, f"grammar_{name}") for _, name, *_ in _GRAMMAR_FLAGS})
    except ValueError as exc:
        flag = next(flag for flag, name, *_ in _GRAMMAR_FLAGS if name == getattr(exc, "field", None))
        parser.error(f"{flag}: {exc}")
    data_parallel = data_parallel_config(parser, args)
    server = ServerArgs(
        model=model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=_api_key(parser, args.api_key),
        chat_template=args.chat_template,
        reasoning_parser=args.reasoning_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        max_waiting_requests=args.max_waiting_requests,
        lora_modules=dict(args.lora_modules),
        max_request_body_mb=args.max_request_body_mb,
        max_logprob_entries=args.max_logprob_entries,
        header_read_timeout=args.header_read_timeout,
        body_read_timeout=args.body_read_timeout,
        timeout_keep_alive=args.timeout_keep_alive,
        shutdown_timeout=args.shutdown_timeout,
        grammar_budget=budget,
        data_parallel=data_parallel,
    )
    return server, engine


def _api_key(parser: argparse.ArgumentParser, flag: str | None) -> str | None:
    """``--api-key``, else the environment's; an empty one is an error, not a server without authentication."""
    if flag is not None:
        if not flag.strip():
            parser.error("--api-key is empty: give a key, or leave the flag out to serve without authentication")
        return flag
    key = os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        parser.error(f"${API_KEY_ENV} is set but empty: set a key, or unset it to serve without authentication")
    return key


def json_dict(text: str) -> dict[str, Any]:
    """A flag's value as a JSON object (argparse reports the ValueError as an invalid value)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"a JSON object is needed, got {type(value).__name__}")
    return value
