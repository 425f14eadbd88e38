"""How tests/data/projection-v1.safetensors was written: by the code of commit e98aabe (eogp-index 0.1.0, projection
format 1, float32 P), run as `git archive e98aabe eogp_index | tar -x -C /tmp/old && PYTHONPATH=/tmp/old python
tests/data/make_projection_v1.py` from the repository root. Kept as the provenance of that file."""
import torch

from eogp_index.config import ProjectionConfig, StorageConfig
from eogp_index.fit.curvature import ModuleCurvature
from eogp_index.fit.projection import PROJECTION_FORMAT_VERSION, build_projection, fit_pca

assert PROJECTION_FORMAT_VERSION == 1

def orth(n, gen):
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q.float()

gen = torch.Generator().manual_seed(0)
curv = {}
for name, (d_out, d_in) in {"a": (6, 5), "b": (4, 3)}.items():
    eig = (torch.rand(d_out, d_in, generator=gen, dtype=torch.float64) ** 3).float()
    curv[name] = ModuleCurvature(activation_eigenvectors=orth(d_in, gen), gradient_eigenvectors=orth(d_out, gen),
                                 eigenvalues=eig)
proj = build_projection(curv, ProjectionConfig(variant="eogp", k=4, m=10), StorageConfig())
for name, p in proj.modules.items():
    z = torch.randn(20, p.m, generator=gen)
    p.pca = fit_pca(z, p.k)
print(proj.save("tests/data/projection-v1.safetensors"))
