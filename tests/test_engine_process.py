"""The engine core in its own process, and data-parallel replicas (local processes, Ray).

Offline: process mode gives the in-process engine's outputs (greedy tokens, logprobs,
seeded samples, stop strings, grammars, aborts); a core that fails to start raises the
same error; a core that dies ends the engine with EngineDeadError, no hang.
Server: 32 concurrent requests over DP = 2 (processes and Ray actors) all complete,
both replicas serve some, outputs equal the offline ones; killing a replica fails its
requests cleanly and the survivor serves the next ones.
"""
from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from live_server import live_server
from tokenmill import LLM, SamplingParams
from tokenmill.errors import EngineDeadError

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

SMALL = dict(dtype="float32", max_model_len=256, num_kv_blocks=96, max_num_seqs=8)
PROMPTS = [{"prompt_token_ids": [3 + i, 17, 29 + 2 * i, 41, 5 + i * 7][: 3 + i % 3]}
           for i in range(10)]


def _generate(llm, params):
    return [[list(c.token_ids) for c in o.outputs] for o in llm.generate(PROMPTS, params,
                                                                         use_tqdm=False)]


@pytest.fixture(scope="module")
def inproc(demo_path):
    return LLM(demo_path, **SMALL)


@pytest.fixture(scope="module")
def proc_llm(demo_path):
    llm = LLM(demo_path, engine_process=True, **SMALL)
    yield llm
    llm.llm_engine.shutdown()


def test_process_mode_matches_in_process(inproc, proc_llm):
    greedy = SamplingParams(temperature=0, max_tokens=14, logprobs=2)
    a = inproc.generate(PROMPTS, greedy, use_tqdm=False)
    b = proc_llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    for x, y in zip(a, b):
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert lx.keys() == ly.keys()
            for t in lx:
                assert abs(lx[t].logprob - ly[t].logprob) < 1e-5
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11, n=2, max_tokens=10)
    assert _generate(inproc, seeded) == _generate(proc_llm, seeded)
    penalties = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3,
                               frequency_penalty=0.5, stop_token_ids=[7])
    assert _generate(inproc, penalties) == _generate(proc_llm, penalties)


def test_process_mode_stop_strings_and_grammar(inproc, proc_llm):
    stop = SamplingParams(temperature=0, max_tokens=24, stop=["e"])
    a = inproc.generate(["Hello there", "The mill"], stop, use_tqdm=False)
    b = proc_llm.generate(["Hello there", "The mill"], stop, use_tqdm=False)
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]
    assert [o.outputs[0].finish_reason for o in a] == [o.outputs[0].finish_reason for o in b]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    from tokenmill.structured_output.params import StructuredOutputsParams
    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=schema))
    out = proc_llm.generate(["Give me JSON:"], params, use_tqdm=False)[0].outputs[0]
    assert out.text == inproc.generate(["Give me JSON:"], params,
                                       use_tqdm=False)[0].outputs[0].text
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text)["n"], int)


def test_process_mode_abort_frees_everything(proc_llm):
    engine = proc_llm.llm_engine
    for i in range(4):
        engine.add_request(f"ab{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=200,
                                                               ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request([f"ab{i}" for i in range(4)])
    assert not engine.has_unfinished_requests()
    # The core has let go of them: no running request, no KV block in use.
    deadline = time.monotonic() + 10
    while True:
        stats = engine.engine_core.kv_cache_stats()
        if stats["num_used_blocks"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stats["num_used_blocks"] == 0
    assert proc_llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3),
                             use_tqdm=False)[0].outputs[0].token_ids


def test_aborting_requests_whose_outputs_queued_up_leaves_nothing_unfinished(proc_llm):
    """The core runs ahead: outputs of running requests wait in the client's queue when
    they are aborted. Those outputs are stale: right after aborting everything nothing
    is unfinished (a caller looping on has_unfinished_requests() stops), and stepping
    hands nothing out for the aborted requests."""
    engine = proc_llm.llm_engine
    for i in range(2):
        engine.add_request(f"queued{i}", PROMPTS[i], SamplingParams(
            temperature=0, max_tokens=250, ignore_eos=True))
    deadline = time.monotonic() + 30
    while not engine.engine_core._outputs:  # a step's message waits, not handed out
        assert time.monotonic() < deadline
        time.sleep(0.02)
        engine.engine_core.stats()
    queued = [out for batch in engine.engine_core._outputs for out in batch]
    assert queued and not any(out.finished for out in queued)
    engine.abort_request(["queued0", "queued1"])
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_outputs_that_queued_up_come_one_core_step_at_a_time(proc_llm):
    """The core runs ahead of a busy front end: its steps' messages queue, and each
    step() hands out one of them, so a request never gets two entries in one output
    (a stream would see a chunk after its final one)."""
    from tokenmill.sampling_params import RequestOutputKind
    engine = proc_llm.llm_engine
    engine.add_request("burst", PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
    deadline = time.monotonic() + 30
    while len(engine.engine_core._outputs) < 3:  # several steps' messages wait
        assert time.monotonic() < deadline
        time.sleep(0.05)
        engine.engine_core.stats()  # reads what arrived, hands nothing out
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert len(out.outputs) == 1
            seen.append(out)
    assert sum(len(o.outputs[0].token_ids) for o in seen) == 12
    assert [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]


def test_a_core_that_cannot_start_raises_its_error(demo_path):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(demo_path, engine_process=True, dtype="float32", max_model_len=256,
            num_kv_blocks=4)


def test_a_dead_core_ends_the_engine_without_a_hang(demo_path):
    llm = LLM(demo_path, engine_process=True, **SMALL)
    engine = llm.llm_engine
    try:
        engine.add_request("x", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200,
                                                          ignore_eos=True))
        engine.step()
        os.kill(engine.engine_core.replicas[0].info.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            time.sleep(0.5)  # gone: a send to it must not block for good
            for i in range(3):
                engine.add_request(f"after{i}", PROMPTS[1], SamplingParams(max_tokens=4))
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 10
    finally:
        engine.shutdown()


def test_data_parallel_offline_matches(inproc, demo_path):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    llm = LLM(demo_path, data_parallel_size=2, **SMALL)
    try:
        assert _generate(llm, greedy) == _generate(inproc, greedy)
        routed = [r["requests_routed"] for r in llm.llm_engine.engine_core.replica_stats()]
        assert all(n > 0 for n in routed) and sum(routed) == len(PROMPTS)
        # n > 1: the completions of one request stay on one replica (shared prompt blocks).
        seeded = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=8)
        assert _generate(llm, seeded) == _generate(inproc, seeded)
    finally:
        llm.llm_engine.shutdown()


def test_bad_parallel_args(demo_path):
    for kwargs, field in ((dict(data_parallel_size=0), "data_parallel_size"),
                          (dict(data_parallel_size=True), "data_parallel_size"),
                          (dict(distributed_executor_backend="mpi"),
                           "distributed_executor_backend"),
                          (dict(engine_process="yes"), "engine_process")):
        with pytest.raises(ValueError, match=field):
            LLM(demo_path, **SMALL, **kwargs)


# ---- the server over DP = 2 -----------------------------------------------------------
def _completion(url: str, prompt: list[int], max_tokens: int = 12) -> dict:
    resp = httpx.post(f"{url}/v1/completions", json={
        "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=120)
    return {"status": resp.status_code, "body": resp.json()}


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", timeout=10).json()


def _check_dp_server(url: str, inproc) -> None:
    prompts = [[(7 * i + j) % 4000 + 3 for j in range(4 + i % 9)] for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda p: _completion(url, p), prompts))
    assert all(r["status"] == 200 for r in results), results[:2]
    expected = inproc.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [r["body"]["choices"][0]["text"] for r in results] == \
        [o.outputs[0].text for o in expected]
    replicas = _stats(url)["replicas"]
    assert len(replicas) == 2 and all(r["requests_routed"] > 0 for r in replicas)


SERVER_ARGS = ("--served-model-name", "demo", "--dtype", "float32", "--max-model-len", "256",
               "--num-kv-blocks", "96", "--max-num-seqs", "8", "--log-stats-interval", "0",
               "--data-parallel-size", "2")


def test_data_parallel_server(demo_path, inproc, tmp_path):
    with live_server(demo_path, tmp_path / "server.log", *SERVER_ARGS) as srv:
        _check_dp_server(srv.url, inproc)
        # The "mp" backend's replicas: the server's own child processes.
        pids = [r["pid"] for r in _stats(srv.url)["replicas"]]
        if os.path.isdir("/proc"):
            assert all(_parent_pid(pid) == srv.proc.pid for pid in pids)


def test_a_killed_replica_fails_its_requests_and_the_server_goes_on(demo_path, tmp_path,
                                                                     inproc):
    with live_server(demo_path, tmp_path / "server.log", *SERVER_ARGS) as srv:
        victim = _stats(srv.url)["replicas"][0]["pid"]
        long = [[11 + i, 12, 13] for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_completion, srv.url, p, 220) for p in long]
            deadline = time.monotonic() + 60
            while _stats(srv.url)["replicas"][0]["unfinished"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            os.kill(victim, signal.SIGKILL)
            results = [f.result() for f in futures]
        failed = [r for r in results if r["status"] != 200]
        assert failed, "the killed replica's requests must fail"
        assert all(r["status"] == 500 or "error" in json.dumps(r["body"]) for r in failed)
        assert any(r["status"] == 200 for r in results)  # the survivor's
        replicas = _stats(srv.url)["replicas"]
        assert [r["alive"] for r in replicas] == [False, True]
        after = _completion(srv.url, [5, 6, 7])
        assert after["status"] == 200
        assert after["body"]["choices"][0]["text"] == inproc.generate(
            [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=12),
            use_tqdm=False)[0].outputs[0].text
        assert srv.proc.poll() is None


def test_data_parallel_over_ray(demo_path, inproc, tmp_path):
    """The server over DP = 2 with the Ray backend: the replicas are actors of the Ray
    cluster started here (worker processes of its raylet, not the server's own
    children as the "mp" backend's are), and serve as the processes do."""
    pytest.importorskip("ray")
    # A local Ray cluster on 127.0.0.1, started here; the server joins it by address.
    import subprocess
    import sys
    import tempfile
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's sockets live there
    from live_server import free_port
    port = free_port()
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    start = subprocess.run([ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1",
                            "--port", str(port), "--num-cpus", "2", "--include-dashboard",
                            "false", "--disable-usage-stats", "--temp-dir", str(ray_dir)],
                           capture_output=True, text=True, timeout=180)
    assert start.returncode == 0, start.stderr[-2000:]
    try:
        env = {"RAY_ADDRESS": f"127.0.0.1:{port}"}
        with live_server(demo_path, tmp_path / "server.log", *SERVER_ARGS,
                         "--distributed-executor-backend", "ray", extra_env=env,
                         timeout=300) as srv:
            _check_dp_server(srv.url, inproc)
            pids = [r["pid"] for r in _stats(srv.url)["replicas"]]
            assert len(set(pids)) == 2 and srv.proc.pid not in pids
            if os.path.isdir("/proc"):
                assert all(_parent_pid(pid) != srv.proc.pid for pid in pids)
            srv.log.seek(0)
            assert "(ray)" in srv.log.read()  # the core client's start-up line: its backend
    finally:
        subprocess.run([ray_bin, "stop", "--force"], capture_output=True, timeout=120)
        import shutil
        shutil.rmtree(ray_dir, ignore_errors=True)


def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:  # "pid (comm) state ppid ...", comm may hold spaces
        return int(f.read().rsplit(")", 1)[1].split()[1])
