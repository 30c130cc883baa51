"""ARCHITECTURE.md claims about the engine core in its own process that no other test
shows.

* "PR_SET_PDEATHSIG and a parent check end a core whose front end died": a front
  end (a Python process of its own, started here) is killed with SIGKILL, and its
  core must go within seconds: (a) while the core is busy with a long request, which
  only the kernel's PR_SET_PDEATHSIG can end in time (the parent check runs in the
  idle loop only, and a busy core whose outputs nobody reads ends up blocked in its
  send); (b) with PR_SET_PDEATHSIG switched off in the core, an idle core must notice
  the new parent pid by itself.
* "a core's start failure that is not a ValueError becomes a RuntimeError": a
  checkpoint whose safetensors header is corrupt makes the core's build raise
  safetensors' SafetensorError (not a ValueError); the front end raises a
  RuntimeError that names it. (A ValueError staying a ValueError:
  test_engine_process.py::test_a_core_that_cannot_start_raises_its_error.)
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tokenmill import LLM

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc; PR_SET_PDEATHSIG is Linux's")

# The front end, run as a file: the core is started with multiprocessing's spawn, which
# imports this file again in the core (as __mp_main__), so the top-level switch below
# applies in the core too.
FRONT_END = textwrap.dedent("""
    import sys, time
    if "no-pdeathsig" in sys.argv:
        from tokenmill.engine import core_proc
        core_proc.die_with_parent = lambda: None
    if __name__ == "__main__":
        from tokenmill import LLM, SamplingParams
        llm = LLM(sys.argv[1], engine_process=True, dtype="float32", max_model_len=4096,
                  num_kv_blocks=300, max_num_seqs=2)
        engine = llm.llm_engine
        busy = "busy" in sys.argv
        if busy:  # longer than the test waits: the core runs it all along
            engine.add_request("long", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(
                temperature=0, max_tokens=4000, ignore_eos=True))
            while not engine.step():
                pass
        print("core", engine.engine_core.replicas[0].info.pid, flush=True)
        while True:
            engine.step() if busy else time.sleep(1)
""")


def _state(pid: int) -> str | None:
    """The process's state letter, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")  # a zombie has exited (nobody reaped it)


def _core_outlives_its_front_end(demo_path: str, tmp_path, *flags: str,
                                 wait_s: float) -> bool:
    """Start a front end with `flags`, SIGKILL it once its core is up (and busy with
    "busy"); True when the core is still alive `wait_s` seconds later."""
    script = tmp_path / "front_end.py"
    script.write_text(FRONT_END)
    # Its zmq socket folder (left behind by a killed front end) goes to tmp_path.
    env = dict(os.environ, TMPDIR=str(tmp_path))
    fe = subprocess.Popen([sys.executable, str(script), demo_path, *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    core = None
    try:
        line = fe.stdout.readline()  # the front end blocks here until the core is up
        assert line.startswith("core "), f"front end said {line!r} (exit {fe.poll()})"
        core = int(line.split()[1])
        assert _alive(core)
        fe.kill()
        fe.wait(10)
        deadline = time.monotonic() + wait_s
        while _alive(core) and time.monotonic() < deadline:
            time.sleep(0.05)
        return _alive(core)
    finally:
        if fe.poll() is None:
            fe.kill()
            fe.wait(10)
        if core is not None and _alive(core):
            os.kill(core, signal.SIGKILL)  # the one this test started, never left behind


def test_pdeathsig_ends_a_busy_core_whose_front_end_was_killed(demo_path, tmp_path):
    assert not _core_outlives_its_front_end(demo_path, tmp_path, "busy", wait_s=3.0)


def test_an_idle_core_notices_its_front_end_is_gone_without_pdeathsig(demo_path, tmp_path):
    from tokenmill.engine.core_proc import IDLE_POLL_MS
    assert not _core_outlives_its_front_end(demo_path, tmp_path, "no-pdeathsig",
                                            wait_s=IDLE_POLL_MS / 1000 + 3.0)


def test_a_core_start_failure_that_is_not_a_value_error_is_a_runtime_error(demo_path,
                                                                          tmp_path):
    bad = str(tmp_path / "corrupt")
    shutil.copytree(demo_path, bad)
    weights = os.path.join(bad, "model.safetensors")
    with open(weights, "r+b") as f:  # the JSON header (after its 8-byte length) is garbage
        f.seek(8)
        f.write(b"{not json")
    args = dict(dtype="float32", max_model_len=256, num_kv_blocks=64)
    from safetensors import SafetensorError
    assert not issubclass(SafetensorError, ValueError)
    with pytest.raises(SafetensorError):  # what the build raises, in process
        LLM(bad, **args)
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        LLM(bad, engine_process=True, **args)
    # The core closes both its sockets before it leaves (an open one held its exit until
    # the front end killed it, 10 s later).
    assert time.monotonic() - start < 8
    assert type(info.value) is RuntimeError
    assert str(info.value).startswith("SafetensorError: ")
    assert "header" in str(info.value)


SILENT_DEATH = textwrap.dedent("""
    import os, sys
    if __name__ == "__mp_main__":  # in the core, as spawn imports this file: die unheard
        os._exit(3)
    if __name__ == "__main__":
        from tokenmill import LLM
        try:
            LLM(sys.argv[1], engine_process=True, dtype="float32", max_model_len=256,
                num_kv_blocks=64)
        except RuntimeError as e:
            print("raised", e, flush=True)
""")


def test_a_core_that_dies_unheard_while_starting_fails_the_start_promptly(demo_path,
                                                                         tmp_path):
    """A core killed while it starts (an OOM kill, a bootstrap error) says nothing: the
    front end raises "exited while starting" and returns, instead of trying to tell the
    dead core to shut down for ever."""
    script = tmp_path / "silent.py"
    script.write_text(SILENT_DEATH)
    out = subprocess.run([sys.executable, str(script), demo_path], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert "raised engine core 0 exited while starting (exit code 3)" in out.stdout, (
        out.stdout, out.stderr[-2000:])


@pytest.mark.xfail(strict=True, reason=(
    "README claims vLLM's spaces_between_special_tokens; transformers 5's Python "
    "tokenizers ignore the option tokenmill passes to decode(), and fast tokenizers are "
    "never given it, so the text is the same either way"))
def test_spaces_between_special_tokens_spaces_added_tokens_as_vllm_does():
    """vLLM (a slow tokenizer: SlowIncrementalDetokenizer, detokenizer_utils'
    _convert_tokens_to_string_with_added_encoders) joins the text around added tokens
    with a space when the option is True, with nothing when False. A strict xfail:
    whoever makes it true sees this pass (and fail as XPASS), and can keep the claim."""
    from transformers import ByT5Tokenizer  # a Python (slow) tokenizer needing no files

    from tokenmill.engine.detokenizer import IncrementalDetokenizer
    tok = ByT5Tokenizer(extra_ids=3)
    assert not tok.is_fast
    ids = tok.encode("ab<extra_id_0><extra_id_1>cd", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["a", "b", "<extra_id_0>", "<extra_id_1>",
                                              "c", "d"]

    def text(spaces: bool) -> str:
        d = IncrementalDetokenizer(tok, [], skip_special_tokens=False,
                                   spaces_between_special_tokens=spaces)
        return "".join(d.update([i]) for i in ids) + d.finish()
    assert text(False) == "ab<extra_id_0><extra_id_1>cd"
    assert text(True) == "ab <extra_id_0> <extra_id_1> cd"
