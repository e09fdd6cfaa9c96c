import os, subprocess, sys, pathlib
src = pathlib.Path("hwgraph/attention/triton_kernel.py").read_text()
patches = {
    "default": [],
    "noprec": [('input_precision="ieee"', 'out_dtype=tl.float32')] ,
    "pv_single": [("""    v_a = load_tile(v_ptr + offs_a[None, :], ka_mask, MASK_A)
    acc_a = acc_a * alpha[:, None] + tl.dot(p, v_a.to(DOT_DTYPE), input_precision="ieee")
    if HAS_B:
        v_b = tl.load(v_ptr + offs_b[None, :], mask=kb_mask, other=0.0)
        acc_b = acc_b * alpha[:, None] + tl.dot(p, v_b.to(DOT_DTYPE), input_precision="ieee")""",
    """    offs_w = tl.arange(0, 128)
    v_w = tl.load(v_ptr + offs_w[None, :], mask=(cols < seqlen)[:, None] & (offs_w < HEAD_DIM)[None, :], other=0.0)
    acc_a = acc_a * alpha[:, None] + tl.dot(p, v_w.to(DOT_DTYPE), input_precision="ieee")"""),
    ("        acc_a = tl.zeros([BLOCK_M, D_A], tl.float32)", "        acc_a = tl.zeros([BLOCK_M, 128], tl.float32)"),
    ("""        tl.store(out_ptr + offs_a[None, :], (acc_a * inv_l[:, None]).to(Out.dtype.element_ty),
                 mask=row_mask[:, None] & a_mask[None, :])
        if HAS_B:""", """        offs_w = tl.arange(0, 128)
        tl.store(out_ptr + offs_w[None, :], (acc_a * inv_l[:, None]).to(Out.dtype.element_ty),
                 mask=row_mask[:, None] & (offs_w < HEAD_DIM)[None, :])
        if False:""")],
    "qk_single": [("""    k_a = load_tile(k_ptr + offs_a[None, :], ka_mask, MASK_A)
""", """    offs_w = tl.arange(0, 128)
    k_w = tl.load(k_ptr + offs_w[None, :], mask=(cols < seqlen)[:, None] & (offs_w < HEAD_DIM)[None, :], other=0.0)
    k_a = load_tile(k_ptr + offs_a[None, :], ka_mask, MASK_A)
"""),
    ("""    s = tl.dot(q_a, tl.trans(k_a.to(DOT_DTYPE)), input_precision="ieee")
    if HAS_B:""", """    s = tl.dot(q_a, tl.trans(k_w.to(DOT_DTYPE)), input_precision="ieee")
    if False:"""),
    ("""        q_a = tl.load(q_ptr + offs_a[None, :], mask=row_mask[:, None] & a_mask[None, :], other=0.0).to(DOT_DTYPE)""",
     """        offs_w = tl.arange(0, 128)
        q_a = tl.load(q_ptr + offs_w[None, :], mask=row_mask[:, None] & (offs_w < HEAD_DIM)[None, :], other=0.0).to(DOT_DTYPE)""")],
}
code = r'''
import os, sys, torch, triton, importlib.util
dev = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[sys.argv[3]] if dev == "cuda" else torch.float32
spec = importlib.util.spec_from_file_location("tkv", sys.argv[1]); tk = importlib.util.module_from_spec(spec); spec.loader.exec_module(tk)
tokens = 196
torch.manual_seed(0)
q, k, v = (torch.randn(tokens, 16, 72, device=dev, dtype=dt) for _ in range(3))
cu = torch.tensor([0, tokens], device=dev, dtype=torch.int32)
out = torch.empty_like(q)
meta = dict(HEAD_DIM=72, BLOCK_M=64, BLOCK_N=64, D_A=64, D_B=int(sys.argv[2]), HAS_B=True, A_PADDED=False, DOT_DTYPE={torch.bfloat16: tk.tl.bfloat16, torch.float16: tk.tl.float16, torch.float32: tk.tl.float32}[dt], num_warps=4, num_stages=2)
grid = (triton.cdiv(tokens, 64), 16, 2)
tk.varlen_attention_kernel[grid](q, k, v, out, cu, tokens, 1, 72**-0.5 * tk.LOG2_E, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), **meta)
torch.cuda.synchronize() if dev == "cuda" else None
ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])[0].transpose(0, 1)
print(triton.__version__, "ok, err", ((out.float() - ref.float()).norm() / ref.float().norm()).item())
'''
for name, reps in patches.items():
    text = src
    for a, b in reps:
        assert a in text, (name, a)
        text = text.replace(a, b)
    path = f"/tmp/tk_{name}.py"
    pathlib.Path(path).write_text(text)
    for db, dt in (("16", "bf16"), ("32", "bf16"), ("16", "fp16"), ("16", "fp32")):
        if name != "default" and dt != "bf16":
            continue
        r = subprocess.run([sys.executable, "-c", code, path, db, dt], capture_output=True, text=True, env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
        print(name, "D_B", db, dt, "rc", r.returncode, r.stdout.strip(), r.stderr.strip().splitlines()[-1:] if r.returncode else "")
