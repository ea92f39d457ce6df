import os,json;os.environ["CUBLAS_WORKSPACE_CONFIG"]=":4096:8"
import torch,torch.nn.functional as F
from llmkernels.scaling import data as D,model as M
from llmkernels.scaling.plan import *
from llmkernels.scaling.train import *
C=torch.device("cuda");Q=[0];r0=M.BACKEND_OPS["kernels"]["rope"]
def rope(q,k,*a,**kw):
 if Q[0]:q,k=F.rms_norm(q,(64,)),F.rms_norm(k,(64,))
 return r0(q,k,*a,**kw)
M.BACKEND_OPS["kernels"]["rope"]=rope
def det(on):torch.use_deterministic_algorithms(bool(on));torch.utils.deterministic.fill_uninitialized_memory=False
o={}
for on in(0,1):
 det(on);g=[]
 try:
  for _ in"ab":
   x=[torch.randn(64,4,512,64,device=C,dtype=torch.bfloat16,generator=torch.Generator(C).manual_seed(i)).requires_grad_()for i in range(3)]
   F.scaled_dot_product_attention(*x,is_causal=True).float().square().sum().backward();g.append([t.grad for t in x])
  o[f"sdpa{on}"]=[torch.equal(a,b)for a,b in zip(*g)]
 except Exception as e:o[f"sdpa{on}"]=str(e)[:200]
print(o,flush=True)
c=D.prepare(D.DataConfig(max_bytes=10**8),"/tmp/d");T=torch.from_numpy(c.train).to(C);V=torch.from_numpy(c.val).to(C)
W={"final":eval_windows(V,512,1<<20),"curve":eval_windows(V,512,1<<16)};R=[]
def go(L,w,m,q,on):
 det(on);Q[0]=q;mc=ModelConfig(320,L,w);r=make_run("lr",4.17e14,mc,LRRule(),HParams(),lr_mult=m)
 t=TrainConfig(steps=r.steps,batch_size=r.batch_size,lr=r.lr,warmup_steps=r.warmup_steps,beta2=r.beta2)
 x=train_run(mc,t,T,W,backend="kernels",device=C,dtype=torch.bfloat16,key={},progress=False)
 R.append([mc.name,m,q,on,x["val_loss"],round(x["train_seconds"],3),[round(p["val_loss"],3)for p in x["curve"]]]);print(R[-1],flush=True)
 json.dump({"ops":o,"runs":R},open(os.environ["OUT"]+"/s.json","w"))
for on in(0,0,1,1):go(4,192,2,0,on)
for q in(0,1):
 for m in(.5,1,2,4):go(6,256,m,q,1)
for m in(1,2,4):go(4,192,m,1,1)
