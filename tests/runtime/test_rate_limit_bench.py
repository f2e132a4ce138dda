"""A 5-second run of bench/rate_limit.py: 2 worker processes under 20 per 0.5 s. No window
of the lease starts (Redis time) holds more than the limit, the total is within 2 % of
what the limit allows, and no window of handler starts shifted by the longest lease to
handler delay holds more either."""

from bench.rate_limit import report, run


async def test_the_rate_limit_bench_for_5_seconds(make_redis, tmp_path):
    server = make_redis()
    result = await run(server.url, tasks=20, period=0.5, seconds=5, workers=2, concurrency=8, log_dir=tmp_path)
    text = report(result)
    print(text)
    assert result.lease_most == 20 and result.ok, text
    assert result.expected == 200 and abs(result.within(result.lease_starts, 1000) - 200) <= 4, text
    assert len(result.per_process) == 2 and all(n > 0 for n in result.per_process.values()), text
    assert result.handler_most_shifted <= 20, text


async def test_the_group_rate_limit_bench_for_5_seconds(make_redis, tmp_path):
    """--group-rate: the same limit on one group, beside a group without one."""
    server = make_redis()
    result = await run(server.url, tasks=20, period=0.5, seconds=5, workers=2, concurrency=8, log_dir=tmp_path,
                       group_rate=True)
    text = report(result)
    print(text)
    assert result.lease_most == 20 and result.ok, text
    assert result.free_starts is not None and len(result.free_starts) == 20_000, text
    assert "group free (no limit):" in text
