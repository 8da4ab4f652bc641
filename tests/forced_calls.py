"""A rollout engine whose first round after every sync is a given turn (a tool call the tiny random models
of the tests would never sample), with the wrapped engine's own log-probs of it (its ``score``); later rounds
are the wrapped engine's samples. For the multi-turn tests of GRPO, distillation and the engines."""

import torch

from trex.data.tokenizer import compact_tokenizer
from trex.data.tool_calls import tool_codec
from trex.models import evaluating
from trex.rollout.sampling import Samples, left_pad, whole_rows

CALCULATOR_CALL = compact_tokenizer().encode(tool_codec("deepseek-v4", thinking=False).assistant(
    "", [{"name": "calculator", "arguments": {"expression": "2+3"}}])).tolist()


class ForcedFirstTurn:
    """Wraps ``engine``; ``model`` (the trainer's) records the forced turn's experts for routing replay."""

    def __init__(self, engine, model, turn: list[int] = CALCULATOR_CALL):
        self.engine, self.model, self.turn, self.first = engine, model, turn, True

    @property
    def version(self):
        return self.engine.version

    def sync(self, model, version):
        self.engine.sync(model, version)
        self.first = True

    def score(self, rows):
        return self.engine.score(rows)

    def close(self):
        self.engine.close()

    def generate(self, prompts, params, uniforms, batch_size, record_routes=False):
        if not self.first:
            return self.engine.generate(prompts, params, uniforms, batch_size, record_routes)
        self.first = False
        n = len(self.turn)
        rows = [p + self.turn for p in prompts]
        logp = [lp[-n:] for lp in self.engine.score(rows)]
        return Samples(prompts, [self.turn] * len(prompts), logp, [True] * len(prompts),
                       self._routes(rows) if record_routes else None, self.engine.version)

    @torch.no_grad()
    def _routes(self, rows: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        """Each row's experts of its fed tokens (all but the last), as the sampler records them."""
        ids, docs = left_pad(rows, 0, self.model.embed.weight.device)
        log = {}
        with evaluating(self.model), whole_rows(self.model):
            self.model(ids, doc_ids=docs, route_log=log)
        width = ids.shape[1]
        return [{k: v[i, width - len(r):width - 1].cpu() for k, v in log.items()} for i, r in enumerate(rows)]
