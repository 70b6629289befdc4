"""The replicas' stats as one engine's: counters and gauges summed, KV usage over all their blocks."""

from heron.engine.data_parallel import sum_stats
from heron.stats import EngineStats


def test_sum_stats():
    a = EngineStats(num_running=2, kv_cache_usage=0.5, num_gpu_blocks=100, prompt_tokens=7, finished={"stop": 1})
    b = EngineStats(
        num_waiting=3, kv_cache_usage=0.2, num_gpu_blocks=300, prompt_tokens=5, finished={"stop": 2, "length": 1}
    )
    total = sum_stats([a, b])
    assert (total.num_running, total.num_waiting, total.prompt_tokens, total.num_gpu_blocks) == (2, 3, 12, 400)
    assert total.kv_cache_usage == (0.5 * 100 + 0.2 * 300) / 400
    assert total.finished == {"stop": 3, "length": 1}
    assert sum_stats([]) == EngineStats()
