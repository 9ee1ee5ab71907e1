"""The MLflow model as the registry stores it: a pyfunc that wraps the HF model dir and generates.

MLflow 3.17's transformers flavor cannot save a transformers 5 model (it fails while building the
flavor config and again while inferring requirements), so the actor is logged as an equivalent pyfunc:
the HF dir is an artifact, and `predict` takes prompts (plain-format dialogue text) and returns
generated responses. `mlflow.pyfunc.load_model("models:/kubealign-actor@champion")` reloads it.

The model is logged "from code" (MLflow's models-from-code: MODEL_CODE, a file that builds the model
by importing this module), not as a cloudpickled object, and `predict` has type hints: MLflow derives
the signature (list[str] -> list[str]) from them and validates inputs against it; the logged input
example adds the params (max_new_tokens, do_sample, temperature) with their defaults.
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc

INPUT_EXAMPLE = (["\n\nHuman: hi\n\nAssistant:"], {"max_new_tokens": 32, "do_sample": False, "temperature": 1.0})
"""(prompts, params) as MLflow's input_example: the params' types and defaults become the signature's."""

MODEL_CODE = """\
# The kubealign actor as an MLflow model from code: mlflow.pyfunc.load_model runs this file.
from mlflow.models import set_model

from kubealign.promotion.registry import ActorModel

set_model(ActorModel())
"""


class ActorModel(mlflow.pyfunc.PythonModel):
    """predict(list of prompts, params={max_new_tokens, temperature, do_sample}) -> list of responses."""

    def load_context(self, context: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = context.artifacts["model_dir"]
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path).eval()

    def predict(self, context: Any, model_input: list[str], params: dict[str, Any] | None = None) -> list[str]:
        import torch

        from kubealign.data.tokenize import encode_prompt, pad_batch

        params = params or {}
        prompts = list(model_input)  # MLflow has validated and converted the input (a DataFrame column too)
        ids, mask = pad_batch([encode_prompt(self.tokenizer, p) for p in prompts], self.tokenizer.pad_token_id, "left")
        with torch.no_grad():
            out = self.model.generate(
                input_ids=torch.tensor(ids),
                attention_mask=torch.tensor(mask),
                max_new_tokens=int(params.get("max_new_tokens", 32)),
                do_sample=bool(params.get("do_sample", False)),
                temperature=float(params.get("temperature", 1.0)),
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
            )
        return self.tokenizer.batch_decode(out[:, len(ids[0]) :], skip_special_tokens=True)
