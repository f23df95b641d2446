"""Greedy decoding with Hugging Face Llama's static and dynamic key/value caches for the prompt lengths on the
command line, each checked token for token against eager; prints "served" when every one matched."""
import sys
import warnings

import torch
import transformers

warnings.filterwarnings("ignore", category=FutureWarning)
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128)
model = transformers.LlamaForCausalLM(config).eval()
compiled = torch.compile(model, backend="tpucompile")  # the settings come from TPUCOMPILE_* (or tpucompile warm)
STEPS = 4


def greedy(m, prompt, kind):
    cache = (transformers.StaticCache(config=config, max_cache_len=48) if kind == "static"
             else transformers.DynamicCache(config=config))
    n = prompt.shape[1]
    torch._dynamo.mark_dynamic(prompt, 1)
    out = m(input_ids=prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(n))
    tokens = []
    for i in range(STEPS):
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token)
        out = m(input_ids=token, past_key_values=cache, use_cache=True, cache_position=torch.tensor([n + i]))
    return torch.cat(tokens, 1)


with torch.no_grad():
    for kind in ("static", "dynamic"):
        for n in [int(a) for a in sys.argv[1:]]:
            prompt = torch.randint(0, config.vocab_size, (2, n))
            assert torch.equal(greedy(compiled, prompt, kind), greedy(model, prompt, kind)), (kind, n)
print("served")
