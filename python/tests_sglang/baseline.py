"""A plain (not disaggregated) SGLang engine's greedy tokens and logprobs for the tests'
prompts: the reference a disaggregated run must equal.
Usage: baseline.py MODEL PROMPTS_JSON OUT_JSON"""

import json
import sys
from pathlib import Path


def main(model: str, prompts: list[list[int]], out: Path) -> None:
    import sglang as sgl

    engine = sgl.Engine(
        model_path=model,
        skip_tokenizer_init=True,
        device="cpu",
        attention_backend="torch_native",
        dtype="float32",
        page_size=1,
        random_seed=0,
        max_total_tokens=4096,
        disable_radix_cache=True,
    )
    try:
        results = []
        # One prompt at a time, as each disaggregated request is computed.
        for ids in prompts:
            r = engine.generate(
                input_ids=ids,
                sampling_params={"temperature": 0, "max_new_tokens": 8},
                return_logprob=True,
            )
            lps = [float(x[0]) for x in r["meta_info"]["output_token_logprobs"]]
            results.append({"output_ids": r["output_ids"], "logprobs": lps})
        out.write_text(json.dumps(results))
    finally:
        engine.shutdown()


if __name__ == "__main__":  # SGLang's engine starts its workers with spawn
    main(sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3]))
