import torch,torch.nn.functional as F
from llmkernels.scaling.model import GPT
from llmkernels.scaling.plan import ModelConfig
from llmkernels.ops.linear_cross_entropy import linear_cross_entropy as lce
C="cuda";G=lambda i:torch.Generator(C).manual_seed(i)
ids=torch.randint(0,320,(64,513),device=C,generator=G(0));up=torch.randn(64,512,256,device=C,generator=G(1))
def twice(f):
 r=[f(),f()];return [n for n in r[0] if not torch.equal(r[0][n],r[1][n])]
def emb(dt):
 w=torch.randn(320,256,device=C,generator=G(2),dtype=dt).requires_grad_();(F.embedding(ids[:,:-1],w)*up.to(dt)).sum().backward();return {"emb":w.grad}
def ce():
 h=torch.randn(32768,256,device=C,generator=G(3),dtype=torch.bfloat16).requires_grad_();w=torch.randn(320,256,device=C,generator=G(4),dtype=torch.bfloat16).requires_grad_()
 lce(h,w,ids[:,1:].reshape(-1),check_targets=False).backward();return {"h":h.grad,"w":w.grad}
torch.manual_seed(0);m=GPT(ModelConfig(320,4,192),"kernels",compute_dtype=torch.bfloat16).to(C)
def step():
 m.zero_grad(set_to_none=True)
 with torch.autocast(C,dtype=torch.bfloat16,cache_enabled=False):l=m(ids[:,:-1],ids[:,1:])
 l.backward();return {n:p.grad.clone() for n,p in m.named_parameters()}
for on in(0,1):
 torch.use_deterministic_algorithms(bool(on))
 print("det",on,"emb fp32",twice(lambda:emb(torch.float32)),"emb bf16",twice(lambda:emb(torch.bfloat16)),"lce",twice(ce),"model",twice(step),flush=True)
