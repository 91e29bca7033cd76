"""Philly and Helios traces (their public formats, written here in miniature) to hetrain traces."""
import json

import pytest

from hetrain.sched.cluster import parse_cluster_spec
from hetrain.sched.gavel import load_throughputs
from hetrain.sched.public_traces import TraceError, convert_public, main
from hetrain.sched.simulator import simulate
from hetrain.sched.trace import parse_trace_lines

PHILLY = [
    {"status": "Pass", "vc": "vc1", "jobid": "application_1_0001", "user": "u1",
     "submitted_time": "2017-10-03 10:00:00",
     "attempts": [{"start_time": "2017-10-03 10:00:30", "end_time": "2017-10-03 11:00:30",
                   "detail": [{"ip": "m1", "gpus": ["gpu0", "gpu1"]}]}]},
    {"status": "Killed", "vc": "vc1", "jobid": "application_1_0002", "user": "u2",
     "submitted_time": "2017-10-03 10:05:00",
     "attempts": [{"start_time": "2017-10-03 10:06:00", "end_time": "2017-10-03 10:16:00",
                   "detail": [{"ip": "m2", "gpus": ["gpu0"]}]},
                  {"start_time": "2017-10-03 10:20:00", "end_time": "2017-10-03 10:30:00",
                   "detail": [{"ip": "m3", "gpus": ["gpu3"]}]}]},
    {"status": "Failed", "vc": "vc2", "jobid": "application_1_0003", "user": "u3",
     "submitted_time": "2017-10-03 10:07:00", "attempts": []},  # never ran: left out
    {"status": "Pass", "vc": "vc2", "jobid": "application_1_0004", "user": "u3",
     "submitted_time": "None", "attempts": []},
]

HELIOS = """job_id,user,vc,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration,queue
1425511,uXB,vcJ,1,1,1,COMPLETED,2020-06-09 18:41:01,2020-06-09 18:41:01,2020-06-10 04:55:09,36848,0
1425512,uVM,vch,4,16,1,FAILED,2020-06-09 18:41:27,2020-06-09 18:41:27,2020-06-09 18:45:36,249,0
1425513,uzq,vcp,0,1,1,COMPLETED,2020-06-09 18:41:28,2020-06-09 18:41:28,2020-06-09 18:50:00,512,0
1425514,uzq,vcp,16,64,2,COMPLETED,2020-06-09 18:42:01,2020-06-09 18:43:01,2020-06-09 19:43:01,3600,60
"""


def _fields(line):
    f = line.rstrip("\n").split("\t")
    return f[0], f[1], int(f[4]), float(f[5]), int(f[6])


def test_philly_converts_gpus_arrivals_and_work(tmp_path):
    src = tmp_path / "cluster_job_log"
    src.write_text(json.dumps(PHILLY))
    lines = convert_public("philly", src)
    assert len(lines) == 2  # the job that never ran and the one without a submission time are left out
    curves = load_throughputs()
    (t1, c1, s1, a1, g1), (t2, c2, s2, a2, g2) = map(_fields, lines)
    assert (c1, a1, g1) == ("philly:application_1_0001", 0.0, 2)
    assert (c2, a2, g2) == ("philly:application_1_0002", 300.0, 1)
    # work: the job type's steps in the recorded run time (attempts summed) on Philly's GPU
    assert s1 == round(3600 * curves[t1].rate("p100", 2))
    assert s2 == round(1200 * curves[t2].rate("p100", 1))
    cluster = parse_cluster_spec("v100:2,p100:2,k80:2")
    jobs = parse_trace_lines(lines, cluster, source="philly")
    assert [j.requested for j in jobs] == [2, 1]
    assert all(f > 0 for f in simulate(jobs, cluster, "goodput").finish)


def test_helios_converts_and_caps_at_eight_gpus(tmp_path):
    src = tmp_path / "cluster_log.csv"
    src.write_text(HELIOS)
    out = tmp_path / "helios.trace"
    assert main(["helios", str(src), str(out)]) == 0
    rows = [_fields(x) for x in out.read_text().splitlines(keepends=True)]
    assert [r[4] for r in rows] == [1, 4, 8]          # the CPU-only job is dropped; 16 GPUs -> 8
    assert [r[3] for r in rows] == [0.0, 26.0, 60.0]  # seconds after the first submission
    curves = load_throughputs()
    assert rows[2][2] == round(3600 * curves[rows[2][0]].rate("v100", 8))
    assert convert_public("helios", src, limit=1) == out.read_text().splitlines(keepends=True)[:1]


def test_bad_public_traces_are_named(tmp_path):
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(TraceError, match="missing"):
        convert_public("helios", bad)
    bad.write_text('{"not": "a list"}')
    with pytest.raises(TraceError, match="JSON list"):
        convert_public("philly", bad)
    bad.write_text("[]")
    with pytest.raises(TraceError, match="no job"):
        convert_public("philly", bad)
