"""An in-process engine whose first round of every step is a given turn (a tool call the tiny random models
of the tests would never sample), scored by the model itself so its log-probs are the model's; later rounds
are sampled as usual. For the multi-turn tests of GRPO and distillation."""

import torch

from trex.data.tokenizer import compact_tokenizer
from trex.data.tool_calls import tool_codec
from trex.models import evaluating
from trex.rollout.engine import InProcessEngine, score_rows
from trex.rollout.sampling import Samples, left_pad, whole_rows

CALCULATOR_CALL = compact_tokenizer().encode(tool_codec("deepseek-v4", thinking=False).assistant(
    "", [{"name": "calculator", "arguments": {"expression": "2+3"}}])).tolist()


class ForcedFirstTurn(InProcessEngine):
    def __init__(self, model, turn: list[int] = CALCULATOR_CALL):
        super().__init__(model)
        self.turn, self.first = turn, True

    def sync(self, model, version):
        super().sync(model, version)
        self.first = True

    def generate(self, prompts, params, uniforms, batch_size, record_routes=False):
        if not self.first:
            return super().generate(prompts, params, uniforms, batch_size, record_routes)
        self.first = False
        n = len(self.turn)
        rows = [p + self.turn for p in prompts]
        logp = [lp[-n:] for lp in score_rows(self.model, rows)]
        return Samples(prompts, [self.turn] * len(prompts), logp, [True] * len(prompts),
                       self._routes(rows) if record_routes else None, self.version)

    @torch.no_grad()
    def _routes(self, rows: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        """Each row's experts of its fed tokens (all but the last), as the sampler records them."""
        ids, docs = left_pad(rows, 0, self.model.embed.weight.device)
        log = {}
        with evaluating(self.model), whole_rows(self.model):
            self.model(ids, doc_ids=docs, route_log=log)
        width = ids.shape[1]
        return [{k: v[i, width - len(r):width - 1].cpu() for k, v in log.items()} for i, r in enumerate(rows)]
