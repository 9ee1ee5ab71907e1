"""The MLflow model as the registry stores it: a pyfunc that wraps the HF model dir and generates.

MLflow 3.17's transformers flavor cannot save a transformers 5 model (it fails while building the
flavor config and again while inferring requirements), so the actor is logged as an equivalent pyfunc:
the HF dir is an artifact, and `predict` takes prompts (plain-format dialogue text) and returns
generated responses. `mlflow.pyfunc.load_model("models:/kubealign-actor@champion")` reloads it.
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc


class ActorModel(mlflow.pyfunc.PythonModel):
    """predict(list of prompts, params={max_new_tokens, temperature, do_sample}) -> list of responses."""

    def load_context(self, context: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = context.artifacts["model_dir"]
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path).eval()

    # No type hints here on purpose: MLflow would try (and fail) to derive a signature from `Any`;
    # the signature is given explicitly when the model is logged.
    def predict(self, context, model_input, params=None):  # noqa: ANN001
        import torch

        from kubealign.data.tokenize import encode_prompt, pad_batch

        params = params or {}
        prompts = model_input.iloc[:, 0].tolist() if hasattr(model_input, "columns") else list(model_input)
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
