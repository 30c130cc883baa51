"""scripts/peers_bench.py, its pure parts: arguments, the workload (tokenmill's own),
the parsers of the peers' outputs, the report. Nothing here installs or runs a peer."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "peers_bench.py"


@pytest.fixture(scope="module")
def pb():
    spec = importlib.util.spec_from_file_location("peers_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_bench"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("peers_bench", None)


# Captured from llama-batched-bench (llama-cpp-python 0.3.36's llama.cpp, 0c1e570) on the
# benchmark model: 4 sequences of 272 + 16 tokens, 2 threads.
BATCHED_SAMPLE = """\
0.00.070.581 W llama_context: n_ctx is not divisible by n_seq_max - rounding down to 2048

llama_batched_bench: n_kv_max = 2048, n_batch = 2048, n_ubatch = 512, flash_attn = -1, \
is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   272 |     16 |    4 |   1152 |    3.024 |   359.78 |    0.267 |   239.80 |    3.291 |   350.05 |

"""

# llama-bench -p 64 -n 16 -t 2 -r 2 -o json, the same build and model (fields trimmed).
LLAMA_BENCH_SAMPLE = """
[
  {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC", "backends": "CPU",
   "model_type": "qwen3 ?B BF16", "n_threads": 2, "flash_attn": -1, "type_k": "f16",
   "type_v": "f16", "n_prompt": 64, "n_gen": 0, "avg_ts": 1254.366840, "stddev_ts": 512.278479,
   "samples_ts": [ 1616.6, 892.131 ]},
  {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC", "backends": "CPU",
   "model_type": "qwen3 ?B BF16", "n_threads": 2, "flash_attn": -1, "type_k": "f16",
   "type_v": "f16", "n_prompt": 0, "n_gen": 16, "avg_ts": 123.183386, "stddev_ts": 8.084709,
   "samples_ts": [ 128.9, 117.5 ]}
]
"""


# ---- arguments ---------------------------------------------------------------------
def test_defaults(pb):
    args = pb.parse_args([])
    assert not args.setup
    assert args.engines == ["vllm", "llamacpp"]
    assert args.dtypes == ["bfloat16"]
    assert args.workloads == ["throughput", "latency"]
    assert (args.num_prompts, args.input_len, args.output_len, args.seed) == (
        128, (32, 512), (32, 256), 0)
    assert (args.latency_input_len, args.latency_output_len) == (64, 128)
    assert args.output_json is None


def test_choices(pb):
    args = pb.parse_args(["--setup", "--engine", "llamacpp", "--dtype", "all", "--workload",
                          "latency", "--num-prompts", "4", "--output-len", "16:16",
                          "--output-json", "x.json"])
    assert args.setup and args.engines == ["llamacpp"]
    assert args.dtypes == ["bfloat16", "float32"] and args.workloads == ["latency"]
    assert args.num_prompts == 4 and args.output_len == (16, 16)
    assert pb.parse_args(["--dtype", "float32"]).dtypes == ["float32"]


@pytest.mark.parametrize("argv", [["--engine", "hf"], ["--dtype", "float16"],
                                  ["--workload", "serve"], ["--num-prompts", "0"],
                                  ["--input-len", "512:32"], ["--output-len", "x"],
                                  ["--latency-warmup", "-1"]])
def test_bad_arguments(pb, argv, capsys):
    with pytest.raises(SystemExit):
        pb.parse_args(argv)


def test_defaults_are_tokenmills(pb):
    """The script's workload defaults are `tokenmill bench throughput` / `latency`'s."""
    from tokenmill.bench.latency import add_latency_args
    from tokenmill.bench.throughput import add_throughput_args
    tp, lat = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_throughput_args(tp)
    add_latency_args(lat)
    t, la, ours = tp.parse_args([]), lat.parse_args([]), pb.parse_args([])
    assert (ours.num_prompts, ours.input_len, ours.output_len, ours.seed) == (
        t.num_prompts, t.input_len, t.output_len, t.seed)
    assert (ours.latency_input_len, ours.latency_output_len, ours.latency_iters,
            ours.latency_warmup) == (la.input_len, la.output_len, la.num_iters, la.num_warmup)


# ---- the workload --------------------------------------------------------------------
def test_throughput_requests_are_tokenmills(pb):
    from tokenmill.bench.throughput import make_workload
    args = pb.parse_args([])
    got = pb.throughput_requests(args, 32000)
    work = make_workload(128, (32, 512), (32, 256), 32000, 0)
    warm = make_workload(4, (16, 32), (4, 8), 32000, 1)  # run_throughput_bench's warmup
    assert got["prompts"] == work.prompts and got["output_lens"] == work.output_lens
    assert got["warmup_prompts"] == warm.prompts
    assert got["warmup_output_lens"] == warm.output_lens
    assert len(got["prompts"]) == 128
    assert all(32 <= len(p) <= 512 for p in got["prompts"])
    json.dumps(got)  # the vLLM worker receives it as JSON


def test_latency_requests_are_tokenmills(pb):
    from tokenmill.bench.latency import make_prompts
    args = pb.parse_args(["--latency-iters", "3"])
    got = pb.latency_requests(args, 32000)
    prompts = make_prompts(1 + 3, 64, 32000, 0)
    assert got["warmup_prompts"] == prompts[:1] and got["prompts"] == prompts[1:]
    assert got["output_len"] == 128


def test_batched_shape_is_the_means(pb):
    assert pb.batched_shape(pb.parse_args([])) == {"npl": 128, "npp": 272, "ntg": 144}
    assert pb.batched_shape(pb.parse_args(["--num-prompts", "4", "--output-len", "16:16"])) == {
        "npl": 4, "npp": 272, "ntg": 16}


# ---- parsers -------------------------------------------------------------------------
def test_parse_batched_bench_markdown(pb):
    rows = pb.parse_batched_bench(BATCHED_SAMPLE)
    assert rows == [{"pp": 272, "tg": 16, "pl": 4, "n_kv": 1152, "t_pp": 3.024,
                     "speed_pp": 359.78, "t_tg": 0.267, "speed_tg": 239.80, "t": 3.291,
                     "speed": 350.05}]
    # generated tokens over the total time, prompt processing included
    assert pb.batched_tok_s(rows[0]) == pytest.approx(4 * 16 / 3.291)


def test_parse_batched_bench_jsonl(pb):
    line = json.dumps({"n_kv_max": 2048, "pp": 272, "tg": 144, "pl": 128, "n_kv": 53248,
                       "t_pp": 20.0, "speed_pp": 1740.8, "t_tg": 30.0, "speed_tg": 614.4,
                       "t": 50.0, "speed": 1064.96})
    rows = pb.parse_batched_bench("some log line\n" + line + "\n")
    assert len(rows) == 1 and rows[0]["pl"] == 128
    assert pb.batched_tok_s(rows[0]) == pytest.approx(128 * 144 / 50.0)


def test_parse_batched_bench_no_row(pb):
    """A context too small: llama-batched-bench prints the header and skips the row."""
    header = "\n".join(BATCHED_SAMPLE.splitlines()[:6])
    assert pb.parse_batched_bench(header) == []
    assert pb.parse_batched_bench("") == []


def test_parse_llama_bench_json(pb):
    tests = pb.parse_llama_bench_json("load logs\n" + LLAMA_BENCH_SAMPLE)
    assert [(t["n_prompt"], t["n_gen"]) for t in tests] == [(64, 0), (0, 16)]
    with pytest.raises(ValueError):
        pb.parse_llama_bench_json("no json here")


def test_parse_cpuinfo(pb):
    text = ("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu sse avx2 avx512f "
            "avx512_bf16 avx512_vnni\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9B14\n")
    cpu = pb.parse_cpuinfo(text)
    assert cpu["model"] == "AMD EPYC 9B14"
    assert cpu["flags"] == {"avx2": True, "avx512f": True, "avx512_bf16": True,
                            "avx512_vnni": True, "amx_tile": False, "amx_bf16": False,
                            "amx_int8": False}
    arm = pb.parse_cpuinfo("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert not any(arm["flags"].values()) and "sve" in arm["all_flags"]


def test_parse_isa_macros(pb):
    text = ("#define __AVX2__ 1\n#define __AVX512F__ 1\n#define __AVX512BF16__ 1\n"
            "#define __SSE2__ 1\n")
    assert pb.parse_isa_macros(text) == ["AVX2", "AVX512F", "AVX512BF16"]


def test_parse_cmake_configure(pb):
    text = ("-- The CXX compiler identification is GNU 12.2.0\n-- llama.cpp version: 0.5.0-dev\n"
            "-- Adding CPU backend variant ggml-cpu: -march=native \n"
            "-- ggml version: 0.25.3\n-- ggml commit:  0c1e570-dirty\n")
    assert pb.parse_cmake_configure(text) == {
        "cpu_variant": "-march=native", "ggml_version": "0.25.3", "ggml_commit": "0c1e570-dirty",
        "llama_version": "0.5.0-dev", "compiler": "GNU 12.2.0"}


# ---- commands and errors ---------------------------------------------------------------
def test_run_cmd_failure_says_what(pb, tmp_path):
    cmd = [sys.executable, "-c", "print('\\n'.join(f'line {i}' for i in range(100))); "
                                 "raise SystemExit(3)"]
    with pytest.raises(pb.StepError) as info:
        pb.run_cmd("demo step", cmd, str(tmp_path / "demo.log"))
    text = info.value.render()
    assert "demo step failed: exit status 3" in text
    assert "command:" in text and "SystemExit(3)" in text
    assert "line 99" in text and "line 10\n" not in text  # the tail only
    log = (tmp_path / "demo.log").read_text().splitlines()
    assert log[0].startswith("$ ") and log[1:] == [f"line {i}" for i in range(100)]


def test_run_cmd_missing_program(pb):
    with pytest.raises(pb.StepError, match="cannot start it"):
        pb.run_cmd("missing", ["/nonexistent/program"])


def test_vllm_env(pb, monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    env = pb.vllm_env(2, str(tmp_path))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == min(2, len(os.sched_getaffinity(0)))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")  # the caller's value wins
    assert pb.vllm_env(2, str(tmp_path))["VLLM_CPU_KVCACHE_SPACE"] == "8"


def test_cpu_key_follows_the_flags(pb):
    a = {"cpu_model": "AMD EPYC", "all_cpu_flags": ["avx2", "avx512f"]}
    b = {"cpu_model": "AMD EPYC", "all_cpu_flags": ["avx2"]}
    assert pb.cpu_key(a) != pb.cpu_key(b) and pb.cpu_key(a) == pb.cpu_key(dict(a))


# ---- the report --------------------------------------------------------------------------
def test_report_shape(pb):
    args = pb.parse_args(["--engine", "all", "--dtype", "bfloat16", "--num-prompts", "4"])
    host = {"cpu_model": "AMD EPYC", "cpu_flags": {f: f == "avx2" for f in pb.CPU_FLAGS},
            "machine": "x86_64", "cores": 2, "mem_gib": 23.5, "all_cpu_flags": ["avx2"]}
    requests = {"prompts": [[1, 2, 3], [4, 5]], "output_lens": [16, 16]}
    results = [
        pb.result_row("vllm", "throughput", "bfloat16", {"tok_s": 200.0, "seconds": 0.16,
                                                         "output_tokens": 32}),
        pb.result_row("llamacpp", "latency", "bfloat16", {"tok_s": 120.0, "seconds": 0.2,
                                                          "pp_tok_s": 1200.0}),
        pb.result_row("llamacpp", "throughput", "bfloat16", None,
                      "llama-batched-bench bfloat16 failed: exit status 1"),
    ]
    engines = {"vllm": {"version": "0.32.0"}, "llamacpp": {"version": "0.3.36 sdist"}}
    report = pb.build_report(args, host, engines, results, pb.workload_summary(args, requests))
    doc = json.loads(json.dumps(report))
    assert set(doc) == {"bench", "created", "host", "threads", "engines", "workloads", "results"}
    assert doc["bench"] == "peers" and "all_cpu_flags" not in doc["host"]
    assert doc["host"]["cpu_flags"]["avx2"] is True
    assert doc["workloads"]["throughput"]["total_output_tokens"] == 32
    assert doc["workloads"]["throughput"]["llama_batched_bench"] == {"npl": 4, "npp": 272,
                                                                     "ntg": 144}
    assert doc["workloads"]["latency"]["output_len"] == 128
    for row in doc["results"]:
        assert set(row) == {"engine", "workload", "dtype", "tok_s", "seconds", "error", "detail"}
    assert doc["results"][1]["detail"] == {"pp_tok_s": 1200.0}
    table = pb.format_table(report)
    assert "AMD EPYC" in table and "avx2" in table
    assert "200.0" in table and "120.0" in table and "FAILED" in table
    assert len(table.splitlines()) == 2 + len(results)


# ---- llama.cpp's quantized runs ------------------------------------------------------------
def test_llama_quant_argument(pb, tmp_path):
    assert pb.parse_args([]).llama_quants == ["Q8_0", "Q4_0", "Q4_K_M"]
    assert pb.parse_args(["--llama-quant", "none"]).llama_quants == []
    assert pb.parse_args(["--llama-quant", "Q4_K_M,Q8_0,Q8_0"]).llama_quants == ["Q4_K_M",
                                                                                 "Q8_0"]
    for bad in ("Q5_0", "q8_0", ","):
        with pytest.raises(SystemExit):
            pb.parse_args(["--llama-quant", bad])
    args = pb.parse_args(["--peers-dir", str(tmp_path)])
    assert pb.gguf_path(args, "bfloat16").endswith("bench-qwen3-512-bf16.gguf")
    assert pb.gguf_path(args, "Q4_K_M").endswith("bench-qwen3-512-Q4_K_M.gguf")
    assert "llama-quantize" in pb.LLAMA_TARGETS


def test_quantized_rows_beside_the_float_gguf(pb):
    args = pb.parse_args(["--engine", "llamacpp", "--dtype", "all", "--llama-quant", "Q8_0,Q4_0"])
    host = {"cpu_model": "AMD EPYC", "cpu_flags": {f: False for f in pb.CPU_FLAGS},
            "machine": "x86_64", "cores": 2, "mem_gib": 23.5}
    results = [pb.result_row("llamacpp", "latency", d, {"tok_s": v, "seconds": 1.0})
               for d, v in (("bfloat16", 50.0), ("float32", 40.0), ("Q8_0", 92.0))]
    results.append(pb.result_row("llamacpp", "latency", "Q4_0", None, "llama-bench Q4_0 failed"))
    report = pb.build_report(args, host, {"llamacpp": {"version": "x"}}, results, {})
    table = pb.format_table(report).splitlines()
    assert table[-2].split()[3:5] == ["Q8_0", "92.0"] and table[-2].endswith("1.84x bf16")
    assert "FAILED" in table[-1] and "x bf16" not in table[-1]
    assert "x bf16" not in table[2] and "x bf16" not in table[3]  # the float rows
