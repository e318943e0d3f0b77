"""Tree rollouts: nodes extended by k branches keep their blocks, shared with their ancestors.

A tree of depth 3 and branching 3 built by extensions equals, node for node, generating each
root-to-leaf path from scratch (greedy, float32: tokens against transformers; sampled: every
node's log-probabilities against transformers' forward over the whole path, which catches any
branch reading another branch's K/V). At the deepest point the pool holds exactly the tree's
distinct blocks plus the copy-on-write copies, and releasing every node empties it.
"""

from __future__ import annotations

import pytest
import torch

from pagedgen import LLM, SamplingParams, TreeNode
from tiny_models import tiny_hf_model, tiny_model_dir

B = 8
PROMPT = torch.randint(3, 500, (13,), generator=torch.Generator().manual_seed(3)).tolist()
LEVELS = (5, 6, 7)   # tokens per level: branch points fall inside blocks and on their edges
K = 3


def make_llm() -> LLM:
    return LLM(str(tiny_model_dir()), dtype="float32", block_size=B, num_blocks=400, threads=1,
               enable_prefix_caching=False)


def build_tree(llm: LLM, params: SamplingParams) -> list[list[TreeNode]]:
    levels = [[llm.tree_root({"prompt_token_ids": PROMPT})]]
    for max_tokens in LEVELS:
        children = llm.extend(levels[-1], K, max_tokens, params)
        levels.append([c for group in children for c in group])
    return levels


def blocks(tokens: int) -> int:
    return -(-tokens // B)


def expected_pool(levels: list[list[TreeNode]]) -> tuple[int, int]:
    """(distinct blocks of the tree, copy-on-write copies) from its geometry. A node covers
    all its tokens but the last (never computed). Extending a node whose covered tokens end
    inside a block copies that block once (the first branch writes into it); the k branches
    then share the first branch's partial block, and k - 1 of them copy it."""
    root = levels[0][0]
    distinct, copies = blocks(len(root.token_ids) - 1), 0
    for level in levels[1:]:
        for node in level:
            covered, parent_covered = len(node.token_ids) - 1, len(node.parent.token_ids) - 1
            distinct += blocks(covered) - blocks(parent_covered)
    for level in levels[:-1]:
        for node in level:
            covered = len(node.token_ids) - 1
            copies += (covered % B != 0) + (K - 1) * ((covered + 1) % B != 0)
    return distinct, copies


def test_greedy_tree_equals_paths_from_scratch_and_pool_holds_exactly_the_tree():
    llm = make_llm()
    levels = build_tree(llm, SamplingParams(temperature=0, ignore_eos=True))
    kv = llm.engine.kv
    distinct, copies = expected_pool(levels)
    assert kv.counters.cow_copies == copies
    assert kv.snapshot().blocks_used == distinct + kv.counters.cow_copies
    assert kv.snapshot().logical_blocks > kv.snapshot().blocks_used   # sharing saved blocks
    assert llm.engine.scheduler.stats.prompt_tokens_computed == len(PROMPT) - 1 + 1 + K + K * K
    kv.check_integrity()

    hf = tiny_hf_model()
    for leaf in levels[-1]:
        new = len(leaf.token_ids) - len(PROMPT)
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True)
        assert leaf.token_ids == out.sequences[0].tolist()
        scores = [float(torch.log_softmax(s[0], -1)[t]) for s, t in
                  zip(out.scores, out.sequences[0, len(PROMPT):].tolist())]
        node, end = leaf, len(scores)
        while node.parent is not None:
            start = end - len(node.new_token_ids)
            assert node.cumulative_logprob == pytest.approx(sum(scores[start:end]), abs=1e-4)
            node, end = node.parent, start

    report = llm.memory_report()
    unshared = report["counterfactual"]["no_sharing"]
    assert unshared["peak_blocks"] == kv.snapshot().logical_blocks   # the tree at its largest
    assert unshared["sharing_saved_blocks"] == unshared["peak_blocks"] - kv.snapshot().blocks_used
    labels = {t["request_id"] for t in report["peak_block_tables"]["sequences"]}
    assert None not in labels and len(report["peak_block_tables"]["sequences"]) == 40

    llm.release([n for level in levels for n in level])
    assert kv.snapshot().blocks_used == 0
    kv.check_integrity()


def test_sampled_branches_each_see_only_their_own_path():
    llm = make_llm()
    levels = build_tree(llm, SamplingParams(temperature=1.0, seed=5, ignore_eos=True))
    leaves = levels[-1]
    assert len({tuple(leaf.token_ids) for leaf in leaves}) > K * K   # branches differ
    hf = tiny_hf_model()
    with torch.no_grad():
        logits = hf(torch.tensor([leaf.token_ids for leaf in leaves])).logits
    for row, leaf in zip(torch.log_softmax(logits.float(), -1), leaves):
        node, end = leaf, len(leaf.token_ids)
        while node.parent is not None:
            start = end - len(node.new_token_ids)
            for position, logprob in zip(range(start, end), node.logprobs):
                token = leaf.token_ids[position]
                assert logprob[token].logprob == pytest.approx(float(row[position - 1, token]),
                                                               abs=1e-4)
            node, end = node.parent, start
    llm.release(levels[0] + levels[1])          # inner nodes first: leaves keep their blocks
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.snapshot().blocks_used > 0
    llm.release(levels[2] + levels[3])
    assert llm.engine.kv.snapshot().blocks_used == 0


def test_released_node_cannot_be_extended():
    llm = make_llm()
    root = llm.tree_root({"prompt_token_ids": PROMPT})
    llm.release(root)
    with pytest.raises(ValueError, match="released"):
        llm.extend([root], 2, 3)


def test_one_token_root_and_deep_greedy_chain_match_generate():
    llm = make_llm()
    root = llm.tree_root({"prompt_token_ids": PROMPT[:1]})
    assert llm.engine.kv.num_tokens(root.seq_id) == 0       # nothing to compute before the last token
    child = llm.extend(root, 1, 9, SamplingParams(temperature=0, ignore_eos=True))[0][0]
    grandchild = llm.extend(child, 1, 4, SamplingParams(temperature=0, ignore_eos=True))[0][0]
    expected = llm.generate([PROMPT[:1]], SamplingParams(temperature=0, max_tokens=13,
                                                         ignore_eos=True), use_tqdm=False)[0]
    assert grandchild.token_ids == PROMPT[:1] + expected.outputs[0].token_ids
    llm.release([root, child, grandchild])
    assert llm.engine.kv.snapshot().blocks_used == 0
