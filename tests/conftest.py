import os
import tempfile

import pytest
import torch

torch.set_num_threads(2)

# step costs measured or learned by tests (and the servers and CLIs they start) stay out of the
# user's cache: they were timed beside other tests and would misprice the user's own runs
os.environ["DSPARK_PROFILES"] = tempfile.mkdtemp(prefix="dspark-profiles-")


@pytest.fixture(scope="session")
def target_fp32():
    from dspark.runtime.loading import load_target
    return load_target(dtype="fp32")


@pytest.fixture(scope="session")
def bench_prompts(target_fp32):
    """8 chat-templated benchmark prompts: 3 humaneval, 3 gsm8k, 2 mt-bench."""
    from dspark.api import encode_prompt
    from dspark.data import load_prompts
    texts = load_prompts("humaneval", 3) + load_prompts("gsm8k", 3) + load_prompts("mt-bench", 2)
    return [encode_prompt(target_fp32.tokenizer, t, chat=True) for t in texts]
