"""A 30-second soak (bench/soak.py): steady offers through one real worker process,
with the bench's own criteria and bounds (accepted == completed, no Redis errors,
Redis memory and worker RSS growth within MAX_REDIS_GROWTH / MAX_RSS_GROWTH)."""

import pytest

from bench.soak import MAX_REDIS_GROWTH, MAX_RSS_GROWTH, MIB, report, soak

pytestmark = pytest.mark.slow


async def test_soak_30_seconds(make_redis, tmp_path):
    server = make_redis()  # a private redis-server; under CI=true a missing binary fails
    result = await soak(server.url, seconds=30, sample_every=2, log_dir=tmp_path)
    text = report(result)
    print(text)
    assert result.samples and result.window()[0].t >= result.warmup, text
    assert result.drained and result.accepted == result.completed == 30 * 500, text  # every offer confirmed
    assert not result.other_outcomes and result.not_created == 0, text
    assert result.errors == 0 and result.worker_exit == 0, text
    assert result.redis_growth() <= MAX_REDIS_GROWTH, f"Redis grew {result.redis_growth() / MIB:.1f} MiB\n{text}"
    assert result.rss_growth() <= MAX_RSS_GROWTH, f"worker RSS grew {result.rss_growth() / MIB:.1f} MiB\n{text}"
    assert result.ok, text
