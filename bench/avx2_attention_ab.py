import sys, time, pyarrow.parquet as pq, torch
import engine.attention as A
from engine import EngineConfig, LLMEngine, SamplingParams
torch.set_num_threads(1)
qs = pq.read_table("/work/shared/data/gsm8k_test.parquet").column("question").to_pylist()
al = pq.read_table("/work/shared/data/alpaca_eval.parquet").column("instruction").to_pylist()
e = LLMEngine.from_model(None, EngineConfig(device="cpu"))
e.generate(qs[:4], SamplingParams(max_tokens=4)); e.reset_prefix_cache()
pairs = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [A.CPU_KERNEL_MAX_PREFILL_PAIRS]
for name, ps in (("alpaca64", al[:64]), ("gsm64", qs[:64])):
    for p in pairs:
        A.CPU_KERNEL_MAX_PREFILL_PAIRS = p
        best = 0
        for _ in range(2):
            t = time.process_time(); outs = e.generate(ps, SamplingParams(max_tokens=32, ignore_eos=True)); dt = time.process_time() - t
            e.reset_prefix_cache(); best = max(best, 64 * 32 / dt)
        print(sys.argv[1], name, f"pairs={p}", f"{best:.1f} out tok/cpu-s", flush=True)
