"""The serving load simulation (costmodel/simulate/serving.py, planner/serving_load.py): its
figures against what queueing and the engine's mechanisms require, and bad input refused."""
from __future__ import annotations

import pytest

from costmodel.simulate.serving import PROMPT_GRID, Replica, highest_rate, poisson_requests, run_engine, simulate_rate
from hardware.errors import ParallaxError
from parallax_cli import main
from planner.serving_load import load_report, plan_at_highest_rate, read_lengths

LENGTHS = [(512, 64)]


def _engine(kv_blocks: int = 100_000, max_sequences: int = 256) -> Replica:
    """10 ms a decode iteration plus 0.1 ms per sequence; 20 us a prompt token."""
    step = 2048 / PROMPT_GRID
    table = tuple(tuple((0.010 + 1e-4 * b if b else 0.0) + 20e-6 * k * step for k in range(PROMPT_GRID + 1))
                  for b in range(max_sequences + 1))
    return Replica(iteration_table=table, prompt_step=step, kv_blocks=kv_blocks, max_sequences=max_sequences,
                   max_batched_tokens=2048)


def test_a_trickle_sees_the_bare_prefill_and_decode():
    sim = simulate_rate(_engine(), 0.5, LENGTHS, requests=200)
    prefill = 512 * 20e-6 * 1e3
    assert prefill <= sim.ttft_ms.p50 <= prefill + 2 * 10.1
    assert sim.tpot_ms.p50 == pytest.approx(10.1, rel=0.05)
    assert sim.preemptions == 0


def test_percentiles_grow_with_the_rate_and_an_overload_queues():
    engine = _engine()
    rates = (5.0, 50.0, 200.0, 2000.0)
    sims = [simulate_rate(engine, r, LENGTHS, requests=400) for r in rates]
    p99 = [s.ttft_ms.p99 for s in sims]
    assert p99 == sorted(p99)
    assert all(s.ttft_ms.p50 <= s.ttft_ms.p90 <= s.ttft_ms.p99 for s in sims)
    assert sims[-1].ttft_ms.p99 > 50 * sims[0].ttft_ms.p99  # beyond capacity the queue, not the engine, sets TTFT
    assert sims[-1].output_tokens_per_s < 2000.0 * 64  # what it delivers is capped below what is offered


def test_below_capacity_the_replica_delivers_what_is_offered():
    """Output tokens/s over the measured completions: the offered rate times the output length."""
    sim = simulate_rate(_engine(), 40.0, LENGTHS, requests=1500)
    assert sim.output_tokens_per_s == pytest.approx(40.0 * 64, rel=0.08)


def test_the_mean_batch_obeys_littles_law():
    """Decoding sequences = rate x the time each spends decoding (its TPOT x its later tokens), at
    a rate that keeps the engine busy (so the busy-time mean is the mean)."""
    sim = simulate_rate(_engine(), 40.0, LENGTHS, requests=1500)
    decoding_time = sim.tpot_ms.mean / 1e3 * (64 - 1)
    assert sim.mean_batch == pytest.approx(40.0 * decoding_time, rel=0.15)


def test_a_full_kv_cache_preempts_and_every_request_still_finishes():
    engine = _engine(kv_blocks=200)  # 3,200 tokens: five 576-token requests
    done, preemptions, _ = run_engine(engine, poisson_requests(200.0, 100, LENGTHS, seed=1))
    assert preemptions > 0
    assert all(r.finished is not None and r.generated >= r.output and r.first_token >= r.arrival for r in done)


def test_the_highest_rate_meets_the_slo_and_a_tenth_more_does_not():
    engine = _engine()
    rate, sim = highest_rate(engine, LENGTHS, slo_ttft_ms=100.0, slo_tpot_ms=30.0, requests=400)
    assert rate > 0 and sim.ttft_ms.p99 <= 100.0 and sim.tpot_ms.p99 <= 30.0
    above = simulate_rate(engine, rate * 1.1, LENGTHS, requests=400)
    assert above.ttft_ms.p99 > 100.0 or above.tpot_ms.p99 > 30.0


def test_a_deployment_under_load_is_priced_from_the_serving_model():
    report = load_report("llama-3-8b", "1xh100-sxm", lengths=[(1024, 128)], rates=[1.0, 4.0], requests=200,
                         slo_ttft_ms=500.0, slo_tpot_ms=50.0)
    best = report.layouts[0]
    assert (best.tp, best.pp, best.replicas) == (1, 1, 1)
    assert best.points[0].ttft_ms.p50 < best.points[1].ttft_ms.p99
    assert best.highest_rate > 0 and best.at_highest.ttft_ms.p99 <= 500.0
    plan = plan_at_highest_rate(report, "llama-3-8b", "1xh100-sxm")
    assert (plan.tp, plan.pp, plan.replicas, plan.request_rate) == (1, 1, 1, best.highest_rate)
    from formats.serving import settings_of

    assert settings_of(plan).max_sequences == plan.estimate.max_concurrent_sequences  # bursts admitted, as simulated


def test_pinned_replicas_keep_every_layout_within_the_gpus():
    """Pinning the replicas and tp leaves pp free, but only where the replicas still fit the GPUs:
    8 replicas of tp=1 on 8 GPUs are pp=1, never pp=8 (64 GPUs)."""
    report = load_report("llama-3.2-1b", "8xh100-sxm", lengths=[(256, 32)], rates=[8.0], requests=100,
                         fixed={"tp": 1, "replicas": 8})
    assert [(lay.tp, lay.pp, lay.replicas) for lay in report.layouts] == [(1, 1, 8)]
    with pytest.raises(ParallaxError):
        load_report("llama-3.2-1b", "8xh100-sxm", lengths=[(256, 32)], rates=[8.0], requests=100,
                    fixed={"tp": 2, "replicas": 8})


def test_a_target_rate_takes_the_fewest_replicas_that_meet_the_slos():
    """Each layout's replicas for the target are the fewest whose highest SLO rate covers it;
    one replica fewer would not. Layouts rank by the GPUs they need, and the plan written is the
    target on the first one's replicas."""
    slo = {"slo_ttft_ms": 500.0, "slo_tpot_ms": 50.0}
    report = load_report("llama-3-8b", "4xh100-sxm", lengths=[(1024, 128)], rates=[], requests=200,
                         target_rate=40.0, top_k=8, **slo)
    gpus = [lay.at_target.gpus for lay in report.layouts if lay.at_target]
    assert gpus == sorted(gpus) and report.layouts[0].at_target is not None
    for lay in report.layouts:
        target, per_replica = lay.at_target, lay.highest_rate / lay.replicas
        assert target.replicas * per_replica >= 40.0 > (target.replicas - 1) * per_replica
        assert target.gpus == target.replicas * lay.tp * lay.pp and target.fits == (target.gpus <= 4)
        assert target.at.ttft_ms.p99 <= 500.0 and target.at.tpot_ms.p99 <= 50.0
    best = report.layouts[0]
    plan = plan_at_highest_rate(report, "llama-3-8b", "4xh100-sxm")
    assert (plan.tp, plan.pp, plan.replicas, plan.request_rate) == (best.tp, best.pp, best.at_target.replicas, 40.0)
    with pytest.raises(ParallaxError, match="target_rate"):
        load_report("llama-3-8b", "4xh100-sxm", lengths=[(1024, 128)], rates=[1.0], target_rate=40.0)


def test_request_lengths_are_read_from_a_csv(tmp_path):
    good = tmp_path / "lengths.csv"
    good.write_text("isl,osl\n100,20\n300,40\n")
    assert read_lengths(good) == [(100, 20), (300, 40)]
    for name, text, field in (("words.csv", "prompt_len,output_len\nten,2\n", "whole number"),
                              ("cols.csv", "a,b\n1,2\n", "prompt_len,output_len"),
                              ("zero.csv", "prompt_len,output_len\n0,5\n", "prompt_len"),
                              ("empty.csv", "", "0 requests")):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ParallaxError, match=field):
            read_lengths(path)


@pytest.mark.parametrize("args", [["--rates", "1,x"], [], ["--rates", "-1"], ["--rates", "1", "--requests", "5"]])
def test_the_cli_refuses_bad_load_input_in_one_line(args, capsys):
    code = main(["serve-load", "llama-3-8b", "--hw", "1xh100-sxm", "--prompt-len", "512", "--output-len", "64", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:")


def test_a_short_run_of_long_requests_is_lengthened_to_their_steady_batch():
    """20 requests of 256 tokens at 10/s arrive in 2 s, half the lifetime of a running request (256
    tokens at about 15 ms): the run is lengthened until the arrivals span three lifetimes, and the
    replica then delivers the rate offered, the gaps rescaled to offer exactly it."""
    sim = simulate_rate(_engine(), 10.0, [(512, 256)], requests=20)
    lifetime = 255 * sim.tpot_ms.p50 / 1e3
    assert sim.requests >= 3 * 10.0 * lifetime * 0.9
    assert sim.output_tokens_per_s == pytest.approx(10.0 * 256, rel=0.03)
    arrivals = [r.arrival for r in poisson_requests(7.0, 300, LENGTHS)]
    assert arrivals[-1] - arrivals[0] == pytest.approx(299 / 7.0, rel=0.02)
