"""Tree rollouts: branches kept in the KV cache for search algorithms (MCTS, tree of thought).

    root = llm.tree_root("Q: ...")                       # computes the prompt once
    children = llm.extend([root], k=4, max_tokens=32)[0] # 4 branches of up to 32 tokens
    grandchildren = llm.extend(children, k=2, max_tokens=32)   # 8 more, in the same steps
    llm.release(children[1:])                            # prune: blocks go back at once

A `TreeNode` holds its blocks (shared with its ancestors and siblings by reference count) until
it is released; extending it never recomputes its prefix: the first branch forks the node's
table, computes the node's last token, and the other branches fork from that one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedgen.engine.outputs import CompletionOutput, Logprob
from pagedgen.engine.sampling_params import SamplingParams


@dataclass(eq=False)
class TreeNode:
    """One node of a rollout tree: the path from the root prompt to here, and its own segment."""

    token_ids: list[int]              # the whole path: prompt + every ancestor's tokens + its own
    new_token_ids: list[int]          # this node's own tokens (empty for a root)
    text: str                         # its own tokens, decoded
    logprobs: list[dict[int, Logprob]] | None   # per own token (logprobs=0 unless asked for more)
    cumulative_logprob: float         # of its own tokens (0 for a root)
    finish_reason: str | None         # "stop" (EOS / stop string) or "length"; None for a root
    parent: TreeNode | None = None
    seq_id: int = -1                  # the engine sequence holding its blocks
    released: bool = False
    children: list[TreeNode] = field(default_factory=list)

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else self.parent.depth + 1

    @property
    def path_cumulative_logprob(self) -> float:
        """Sum of the log-probabilities of every generated token from the root to here."""
        node, total = self, 0.0
        while node is not None:
            total += node.cumulative_logprob
            node = node.parent
        return total


class TreeRollouts:
    """The tree operations of one LLM (its engine and request ids)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.engine = llm.engine
        self._counter = 0

    def root(self, prompt_token_ids: list[int]) -> TreeNode:
        request_id = self._request_id()
        seq = self.engine.add_prefill_request(request_id, prompt_token_ids)
        self.llm._run([request_id], False, None)
        self.engine.kept_by_request.pop(request_id)
        return TreeNode(list(seq.token_ids), [], "", None, 0.0, None, None, seq.seq_id)

    def extend(self, nodes: list[TreeNode], k: int, max_tokens: int,
               params: SamplingParams | None) -> list[list[TreeNode]]:
        params = _branch_params(params, k, max_tokens)
        for node in nodes:
            _check_alive(node)
        request_ids = [self._request_id() for _ in nodes]
        for request_id, node in zip(request_ids, nodes):
            self.engine.add_branch_request(request_id, self.engine.kept[node.seq_id], params)
        outputs = self.llm._run(request_ids, False, None)
        return [self._children(node, request_id, output)
                for node, request_id, output in zip(nodes, request_ids, outputs)]

    def release(self, nodes: TreeNode | Iterable[TreeNode]) -> None:
        for node in [nodes] if isinstance(nodes, TreeNode) else list(nodes):
            if not node.released:
                self.engine.release(node.seq_id)
                node.released = True

    def _children(self, node: TreeNode, request_id: str, output: Any) -> list[TreeNode]:
        seqs = sorted(self.engine.kept_by_request.pop(request_id), key=lambda s: s.sample_index)
        children = [_child(node, seq, completion) for seq, completion in zip(seqs, output.outputs)]
        node.children += children
        return children

    def _request_id(self) -> str:
        self._counter += 1
        return f"tree-{self._counter}"


def _child(parent: TreeNode, seq: Any, completion: CompletionOutput) -> TreeNode:
    return TreeNode(list(seq.token_ids), completion.token_ids, completion.text,
                    completion.logprobs, completion.cumulative_logprob or 0.0,
                    completion.finish_reason, parent, seq.seq_id)


def _branch_params(params: SamplingParams | None, k: int, max_tokens: int) -> SamplingParams:
    params = params if params is not None else SamplingParams()
    # Logprobs on by default (no alternatives): a search scores its nodes by them.
    logprobs = 0 if params.logprobs is None else params.logprobs
    return dataclasses.replace(params, n=k, max_tokens=max_tokens, logprobs=logprobs)


def _check_alive(node: TreeNode) -> None:
    if not isinstance(node, TreeNode):
        raise TypeError(f"extend takes TreeNode handles, got {type(node).__name__}")
    if node.released:
        raise ValueError("this tree node was released; extend a node that is still held")
