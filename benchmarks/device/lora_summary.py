"""One line of a ``benchmarks/lora_gpu.py`` JSON result for the device scripts' summaries
(``s14_lora.sh``, ``s15_lora.sh``): per decode rank the tok/s of each case, the merged case, whether
``RLSERVE_LORA_MERGE=auto`` kept the fast path, vLLM's big-adapter check; per sync kind its median
and first wall (s) and bytes.

Usage: python benchmarks/device/lora_summary.py RESULT.json"""

import json
import sys

r = json.load(open(sys.argv[1]))
out = [f"{d['engine']} r{d['rank']} tok/s {d['decode_tok_s']} merged {d.get('one_merged_tok_s')} on by default "
       f"{d.get('merge_on_by_default')} big-adapter lp change {d.get('big_adapter_logprob_change')}"
       + (f" cuda after delete {d['cuda_after_delete_gib']}" if "cuda_after_delete_gib" in d else "")
       for d in r.get("decode", [])]
out += [f"{k} median {v['median_s']} s first {v['first_s']} s {v['bytes']} B" for k, v in (r.get("sync") or {}).items()
        if isinstance(v, dict) and "median_s" in v]
if (r.get("sync") or {}).get("cuda_before_gib"):
    out.append(f"GiB before the sync's server {r['sync']['cuda_before_gib']}")
print(" | ".join(out))
