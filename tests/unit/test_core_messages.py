"""The front end / engine core messages: a busy step's outputs round-trip, a request's
SamplingParams arrive with their derived attributes, replica stats merge."""
from __future__ import annotations

import numpy as np

from tokenmill import SamplingParams
from tokenmill.core import serial
from tokenmill.core.sched_output import LogprobsLists
from tokenmill.core.scheduler import EngineCoreOutput
from tokenmill.engine.core_messages import (INPUT_TYPES, OUTPUT_TYPES, AbortCommand, CoreDead,
                                            CoreOutputs, CoreStats, EngineCoreRequest,
                                            FailCommand, FinishCommand, RequestFailure,
                                            UtilityCall, merge_stats)
from tokenmill.structured_output.params import StructuredOutputsParams


def test_a_request_round_trips_with_its_derived_attributes():
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, stop=["END", "x"],
                            stop_token_ids=[9], logit_bias={4: 1.5}, bad_words=["bad"],
                            structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    params.all_stop_token_ids = frozenset({9, 2})
    params.bad_words_token_ids = [[7, 8]]
    req = EngineCoreRequest("r1", [1, 2, 3], params, [2], 12.5, None, "salt")
    back = serial.decode(serial.encode(req), INPUT_TYPES[b"add"])
    assert back == req
    p = back.sampling_params
    assert p.all_stop_token_ids == frozenset({9, 2}) and p.bad_words_token_ids == [[7, 8]]
    # not fields: derived again on arrival
    assert p.stop_token_ids_set == frozenset({9})
    assert p.output_text_buffer_length == 2
    assert p.structured_outputs.cache_key() == params.structured_outputs.cache_key()


def test_a_busy_steps_outputs_round_trip():
    lp = LogprobsLists(np.array([[5, 1, 2]], dtype=np.int64),
                       np.array([[-0.1, -1.5, -2.0]], dtype=np.float32), np.array([1]))
    outs = CoreOutputs([EngineCoreOutput("a", [5], new_logprobs=lp),
                        EngineCoreOutput("b", [], "error", error="boom"),
                        EngineCoreOutput("c", [7, 8], "stop", stop_reason="END")],
                       CoreStats(num_running=2, num_errors={"nan_logits": 1},
                                 spec_decoding={"num_drafts": 1}))
    back = serial.decode(serial.encode(outs), OUTPUT_TYPES[b"out"])
    assert [o.request_id for o in back.outputs] == ["a", "b", "c"]
    assert back.outputs[2].stop_reason == "END" and back.outputs[1].error == "boom"
    assert np.array_equal(back.outputs[0].new_logprobs.logprobs, lp.logprobs)
    assert back.stats == outs.stats
    for kind, msg in ((b"finish", FinishCommand(["a"], "stop", 4)),
                      (b"fail", FailCommand({"a": RequestFailure("output", "why")}, False)),
                      (b"call", UtilityCall(3, "kv_cache_stats")),
                      (b"abort", AbortCommand(["a", "b"]))):
        assert serial.decode(serial.encode(msg), INPUT_TYPES[kind]) == msg
    dead = CoreDead("ValueError", "bad model")
    assert serial.decode(serial.encode(dead), OUTPUT_TYPES[b"dead"]) == dead


def test_replica_stats_merge():
    a = CoreStats(num_running=2, num_waiting=1, num_used_blocks=10, num_kv_blocks=100,
                  num_errors={"fault": 1},
                  spec_decoding={"num_drafts": 4, "num_draft_tokens": 12,
                                 "num_accepted_tokens": 6, "accepted_per_position": [3, 2, 1],
                                 "mean_acceptance_length": 2.5, "acceptance_rate": 0.5},
                  external_kv={"cpu": {"hit_blocks": 2}})
    b = CoreStats(num_running=1, num_used_blocks=30, num_kv_blocks=100,
                  num_errors={"fault": 2, "grammar": 1},
                  spec_decoding={"num_drafts": 4, "num_draft_tokens": 12,
                                 "num_accepted_tokens": 2, "accepted_per_position": [2, 0, 0],
                                 "mean_acceptance_length": 1.5, "acceptance_rate": 0.1667},
                  external_kv={"cpu": {"hit_blocks": 3}})
    m = merge_stats([a, b])
    assert (m.num_running, m.num_waiting, m.num_used_blocks) == (3, 1, 40)
    assert m.kv_cache_usage == 0.2
    assert m.num_errors == {"fault": 3, "grammar": 1}
    assert m.spec_decoding["accepted_per_position"] == [5, 2, 1]
    assert m.spec_decoding["mean_acceptance_length"] == 2.0
    assert m.external_kv == {"cpu": {"hit_blocks": 5}}
    assert a.spec_decoding["num_drafts"] == 4  # the parts are not changed
