"""Whether `torch.isin(tok, eos)` can be captured in a CUDA graph, by batch rows and number of EOS ids (h200_82)."""

import torch


for rows in (1, 2, 64):
    for n_eos in (1, 2, 9, 10, 12, 40):
        tok = torch.randint(0, 1000, (rows,), device="cuda")
        eos = torch.arange(n_eos, device="cuda")
        out = torch.zeros(rows, dtype=torch.bool, device="cuda")
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                out |= torch.isin(tok, eos)
            isin = "ok"
        except Exception as e:  # noqa: BLE001 - the failure is the measurement
            isin = type(e).__name__
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out |= (tok[:, None] == eos[None, :]).any(1)
        print(f"rows={rows} eos_ids={n_eos}: isin {isin}, broadcast compare ok", flush=True)
