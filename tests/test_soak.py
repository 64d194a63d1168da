"""experiments/soak.py in its short mode: 200 mixed requests (streamed or not, sampled or greedy, chats and
completions, clients that disconnect, bursts above --max-waiting) against a real server, then SIGTERM
under load. (A rank killed under load: tests/test_serve.py's dead-rank test; the full run: results/serve/soak.md.)"""

from ladder.bench import soak


def test_the_soak_short_mode_serves_every_request_cuts_no_stream_and_stops_cleanly(tmp_path):
    folder = soak.write_model(tmp_path / "model")
    result, sigterm = soak.run(folder, [1], *soak.SHORT)
    assert result["requests"] == 200  # 156 in rounds of 12, then a burst of 44
    assert set(result["by_status"]) <= {"200", "503 server_overloaded"}, result["by_status"]
    assert result["served"] >= 200 - 44 and result["by_status"].get("503 server_overloaded", 0) > 0
    assert result["streams_cut"] == 0 and result["disconnected"] > 0
    assert result["exit_code"] == 0 and result["tracebacks_in_log"] == 0
    # A short run is mostly warm-up (the first burst grows the allocator's pools): the 5 % bound is the
    # full run's (results/serve/soak.md); this one catches a leak per request.
    assert result["rss_growth"] < 0.15, result
    assert sigterm["finished_or_error"] == sigterm["streams"] == 16 and sigterm["exit_code"] == 0
