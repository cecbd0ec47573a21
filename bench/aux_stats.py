"""Scale of SmolLM2's hidden states per layer on one short chat (fp32, CPU): the median and largest
per-token RMS of the residual stream at layers 0, 2, 15, 27 and 30, and which token is largest.

    PYTHONPATH=. python bench/aux_stats.py
"""
import torch
from eyas.config import TargetConfig
from eyas.target import load_target
t = load_target(TargetConfig(name="smollm2", dtype="float32", device="cpu"))
tok = t.tokenizer
msgs = [{"role": "user", "content": "Explain how a hash table works and give a short Python example."},
        {"role": "assistant", "content": "A hash table stores key-value pairs. It computes a hash of the key to find a bucket index, then stores the value there. Collisions are handled by chaining or open addressing. Example:\n\nd = {}\nd['apple'] = 3\nprint(d['apple'])"}]
ids = tok.apply_chat_template(msgs, return_tensors="pt", return_dict=True)["input_ids"]
with torch.no_grad():
    out = t.model(ids, output_hidden_states=True)
hs = out.hidden_states
print("tokens", ids.shape)
for i in [0, 2, 15, 27, 30]:
    h = hs[i][0]
    rms = h.pow(2).mean(-1).sqrt()
    print(i, "rms per token median %.2f max %.2f (tok %d)" % (rms.median(), rms.max(), rms.argmax()), "max|x| %.1f" % h.abs().max(),
          "top dims", h.abs().max(0).values.topk(4).indices.tolist(), "rms excl tok0 max %.2f" % rms[1:].max())
p = out.logits.softmax(-1)
print("target top1 prob mean", p.max(-1).values.mean().item())
