"""Engine groups: node-local layout checks, and a 2-rank group that gathers prompts and hands each rank its own."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout.groups import check_layout  # noqa: E402


def test_layout_must_tile_the_world_inside_nodes():
    check_layout(2, 8, 4)
    check_layout(1, 3, 3)
    with pytest.raises(ValueError, match="does not divide the 6 ranks"):
        check_layout(4, 6, 6)
    with pytest.raises(ValueError, match="span two nodes"):
        check_layout(4, 8, 2)
    with pytest.raises(ValueError, match="at least 1"):
        check_layout(0, 2, 2)


def group_main(out_dir: str) -> None:
    """Run under torchrun with 2 ranks: rank r contributes r + 1 prompts with seed 100 + r."""
    import torch.distributed as dist

    from models.parallel import init_distributed
    from rollout.base import Generation, PromptInput, SamplingParams
    from rollout.groups import EngineGroup

    init_distributed()
    rank = dist.get_rank()
    group = EngineGroup.build(2, 2, rank, 2)
    mine = [PromptInput([rank, i]) for i in range(rank + 1)]
    prompts, params, start = group.gather(mine, SamplingParams(n=2, seed=100 + rank))
    # what every member's engine returns: n=2 responses per group prompt, echoing its ids
    gens = [Generation(j, list(p.input_ids), [0.0], "stop") for j, p in enumerate(prompts) for _ in range(2)]
    own = group.own(gens, start, len(mine))
    result = {"group_prompts": [p.input_ids for p in prompts], "seed": params.seed, "start": start,
              "own": [(g.prompt_index, g.token_ids) for g in own], "members": group.members()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow
def test_group_gathers_prompts_and_returns_each_rank_its_own(tmp_path):
    from tests.conftest import run_torchrun

    run_torchrun(["tests/test_engine_groups.py", str(tmp_path)], nproc=2, timeout=300)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):  # the same prompts in member order, the first member's seed, on both ranks
        assert r["group_prompts"] == [[0, 0], [1, 0], [1, 1]]
        assert r["seed"] == 100 and r["members"] == [0, 1]
    assert r0["start"] == 0 and r1["start"] == 1
    assert r0["own"] == [[0, [0, 0]], [0, [0, 0]]]
    assert r1["own"] == [[0, [1, 0]], [0, [1, 0]], [1, [1, 1]], [1, [1, 1]]]


if __name__ == "__main__":
    group_main(sys.argv[1])
