"""The exchange's vocabulary (hetrain/modes.py) and where it is parsed: the words users
write (`--mode byteps`, YAML `sync: stale`, `codec: int8`) become enum members once, in
`CommConfig` and the cost model's `Candidate`; the facts the code acts on come from
them; JSON and messages carry the same words as before."""
import json

import pytest

from hetrain.comm.compress import get
from hetrain.errors import UserError
from hetrain.modes import Codec, CodecChoice, Mode, Sync
from hetrain.perf.job import Candidate
from hetrain.runtime.env import CommConfig


def test_mode_facts_match_the_server_table():
    # docs/architecture.md: allreduce none; colocated worker machines; ps CPU machines; byteps both
    table = {"allreduce": (False, False, False), "colocated": (True, True, False), "ps": (True, False, True),
             "byteps": (True, True, True)}
    for word, (servers, on_workers, on_cpus) in table.items():
        m = Mode.parse(word)
        assert (m.has_servers, m.worker_servers, m.cpu_servers) == (servers, on_workers, on_cpus), word
    assert Mode.COLOCATED.priced is Mode.BYTEPS and Mode.PS.priced is Mode.PS


def test_sync_and_codec_facts():
    assert [s.synchronous for s in Sync] == [True, False, False]
    assert Sync.ASYNC.bound(3) == float("inf") and Sync.STALE.bound(3) == 3.0 and Sync.SYNC.bound(3) == 0.0
    assert [c.bits for c in Codec] == [32, 16, 8, 4] and [c.lossy for c in Codec] == [False, True, True, True]
    assert CodecChoice.AUTO.codec is None and CodecChoice.INT8.codec is Codec.INT8
    for c in Codec:  # each codec's class is chosen once by its name
        assert get(c.value).name is c and get(c).bits == c.bits


def test_comm_config_parses_the_words_once_and_writes_them_back():
    c = CommConfig(mode="ps", sync="stale", staleness=2)
    assert c.mode is Mode.PS and c.sync is Sync.STALE and c.codec is CodecChoice.FP32
    assert (c.has_servers, c.synchronous, c.coded, c.bound) == (True, False, False, 2.0)
    data = json.loads(c.to_json())
    assert (data["mode"], data["sync"], data["codec"]) == ("ps", "stale", "fp32")
    assert CommConfig.from_json(c.to_json()) == c
    assert CommConfig(mode="byteps", codec_rules=("*.bias=int8",)).coded
    assert not CommConfig(mode="allreduce").has_servers
    assert f"{CommConfig(mode='colocated').mode}" == "colocated"  # messages show the word


@pytest.mark.parametrize("bad, says", [
    ({"mode": "ring"}, "unknown communication mode 'ring' (--mode); choose byteps, ps, colocated or allreduce"),
    ({"sync": "lazy"}, "unknown training mode 'lazy' (--sync); choose sync, async or stale"),
    ({"codec": "int2"}, "unknown codec 'int2' (--codec); choose fp32, fp16, int8, int4 or auto"),
    ({"mode": "allreduce", "sync": "async"}, "--sync async needs parameter servers"),
    ({"mode": "allreduce", "codec": "fp16"}, "gradient codecs need summation servers"),
    ({"mode": "ps", "sync": "stale", "codec": "int8"}, "codecs are available in synchronous training only"),
])
def test_bad_settings_name_the_flag_and_the_choices(bad, says):
    with pytest.raises(UserError, match="^" + says.replace("(", r"\(").replace(")", r"\)")):
        CommConfig(**bad)


def test_the_cost_model_parses_its_candidates():
    c = Candidate("byteps", "equal", True, "int4")
    assert c.mode is Mode.BYTEPS and c.codec is Codec.INT4 and c.label() == "byteps/equal/overlap/int4"
    assert json.loads(json.dumps({"mode": c.mode, "codec": c.codec})) == {"mode": "byteps", "codec": "int4"}
    with pytest.raises(UserError, match="communication mode 'colocated' does not apply here"):
        Candidate("colocated")
    with pytest.raises(UserError, match="unknown codec 'int3'"):
        Candidate("ps", codec="int3")
