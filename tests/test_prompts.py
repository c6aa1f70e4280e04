"""What part of a record reaches the policy: a verl chat record's system message and earlier turns are rendered
only with the chat template, and a run without it says so instead of dropping them in silence."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rollverify_jax.data.prompts import PromptRenderer, load_prompts, lost_turns
from rollverify_jax.models.tokenizer import Tokenizer

POLICY = Path(__file__).resolve().parents[1] / "assets" / "tiny_policy"


def _verl_parquet(path: Path) -> Path:
    rows = [{"data_source": "s", "prompt": [{"role": "system", "content": "1+1"}, {"role": "user", "content": "3+4"}],
             "reward_model": {"ground_truth": "7", "style": "rule"}, "extra_info": {"index": 0}},
            {"data_source": "s", "prompt": [{"role": "user", "content": "2+2"}],
             "reward_model": {"ground_truth": "4", "style": "rule"}, "extra_info": {"index": 1}}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_a_run_without_the_chat_template_says_which_records_lose_their_system_message(tmp_path, capsys):
    tokenizer = Tokenizer.from_dir(POLICY)
    path = _verl_parquet(tmp_path / "train.parquet")
    records = load_prompts("train", "verl_parquet", {"path": str(path)}, PromptRenderer(tokenizer), 100)
    out = capsys.readouterr().out
    assert "warning: train dataset 'verl_parquet': 1 of 2 records are chat conversations" in out, out
    assert "TrainConfig.chat_template = True" in out
    assert PromptRenderer(tokenizer).render(records[0]) == "3+4"  # what the warning is about: the system turn is gone
    assert lost_turns(records, PromptRenderer(tokenizer, chat=True)) is None  # the template renders them whole
    assert lost_turns([{"prompt": "3+4", "answer": "7"}], PromptRenderer(tokenizer)) is None  # nothing to lose
    two_users = [{"prompt": "b", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}]
    assert lost_turns(two_users, PromptRenderer(tokenizer)).startswith("1 of 1 records")
