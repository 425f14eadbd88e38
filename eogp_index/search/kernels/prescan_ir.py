"""LLVM IR intrinsics of the bounded pre-scan: ``⟨q_u, c⟩`` from packed bits, in integer SIMD.

The inner loop over one module's code words is written in LLVM IR (numba has no vector types,
and its own loops over 8-word modules do not vectorize). Two forms, picked by the dtype of the
query array at compile time:

* int8 query bytes (AVX512-VNNI hosts): each 64-bit code word becomes a mask that selects
  0/1 bytes (VMOVDQU8 with zeroing), and VPDPBUSD adds their products with 64 query bytes;
* uint64 bit planes (any host): the code word is broadcast over the 8 planes of its query
  word, ANDed, popcounted (VPOPCNTQ where available) and weighted once per module.

Code words are read with unaligned 8-byte loads from a module's first byte, so every layout
and every buffer alignment reads the row in place; bits past a module's end meet zero query
entries. Only the store's last row can be read past its end, and the callers
(:mod:`.bounded`) copy that row first.

:func:`_group_prescan` scores ``R`` rows (1 or 4) for one query, :func:`_batch_prescan` ``R``
rows (1 or 2) for a group of :data:`~.base._QUERY_SET` queries. They are ``@intrinsic``s, not
kernels: their arguments are typed one by one at compile time (the codegen reads each array's
data pointer), so they keep their flat argument lists. :func:`_host_has_vnni` says which form
this host can run.
"""

from __future__ import annotations

from llvmlite import ir as llvm_ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from eogp_index.search.kernels.base import _QUERY_SET

_IR_I1 = llvm_ir.IntType(1)
_IR_I8 = llvm_ir.IntType(8)
_IR_I32 = llvm_ir.IntType(32)
_IR_I64 = llvm_ir.IntType(64)
_IR_V16I32 = llvm_ir.VectorType(_IR_I32, 16)
_IR_V64I8 = llvm_ir.VectorType(_IR_I8, 64)
_IR_V8I64 = llvm_ir.VectorType(_IR_I64, 8)
# Bit-plane weights of an 8-bit two's complement integer (the sign plane counts -128).
_PLANE_WEIGHTS = [1, 2, 4, 8, 16, 32, 64, (-128) & ((1 << 64) - 1)]
# Added to every row's bound: the absolute rounding of float32 results in the subnormal range.
_BOUND_TINY = 2.0**-149


def _ir_fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, llvm_ir.FunctionType(ret, args), name)


def _ir_data(context, builder, aty, aval, elem):
    """Data pointer of a numba array, cast to ``elem*``."""
    return builder.bitcast(context.make_array(aty)(context, builder, aval).data, elem.as_pointer())


def _ir_loop(builder, start, stop, step, carried, body, name):
    """``for t = start; t + step <= stop; t += step`` carrying values; returns ``(t, values)``."""
    pre = builder.block
    head = builder.append_basic_block(name + ".head")
    loop = builder.append_basic_block(name + ".body")
    done = builder.append_basic_block(name + ".done")
    builder.branch(head)
    builder.position_at_end(head)
    t = builder.phi(_IR_I64)
    vals = [builder.phi(v.type) for v in carried]
    t.add_incoming(start, pre)
    for phi, v in zip(vals, carried):
        phi.add_incoming(v, pre)
    nxt = builder.add(t, llvm_ir.Constant(_IR_I64, step))
    builder.cbranch(builder.icmp_unsigned("<=", nxt, stop), loop, done)
    builder.position_at_end(loop)
    new = body(t, vals)
    t.add_incoming(nxt, builder.block)
    for phi, v in zip(vals, new):
        phi.add_incoming(v, builder.block)
    builder.branch(head)
    builder.position_at_end(done)
    return t, vals


def _ir_code_word(builder, rp, b0, t):
    """Little-endian 64-bit word of the row at byte ``b0 + 8 t`` (unaligned load)."""
    p = builder.gep(rp, [builder.add(b0, builder.shl(t, llvm_ir.Constant(_IR_I64, 3)))])
    return builder.load(builder.bitcast(p, _IR_I64.as_pointer()), align=1)


def _ir_vnni_dots(builder, rps, b0, nw, qp, qw0, nqg=1):
    """Per row pointer and query, ``Σ_{t<nw} Σ_i bit_i(word t) · int8(q[64 ((qw0 + t) nqg + j) + i])``
    (query ``j`` of a group of ``nqg`` interleaved per word) spread over the 16 int32 lanes of a
    vector; returned row-major (row ``r``, query ``j`` at ``r nqg + j``). Each query load is
    shared by the rows and each expanded code word by the queries; at least four accumulators
    hide VPDPBUSD's latency."""
    nrows = len(rps)
    dpbusd = _ir_fn(builder, "llvm.x86.avx512.vpdpbusd.512", _IR_V16I32, [_IR_V16I32] * 3)
    ones = llvm_ir.Constant(_IR_V64I8, [1] * 64)
    zeros = llvm_ir.Constant(_IR_V64I8, None)

    def word(t, accs):
        wq = builder.mul(builder.add(qw0, t), llvm_ir.Constant(_IR_I64, nqg))
        qs = [
            builder.load(
                builder.bitcast(
                    builder.gep(
                        qp, [builder.shl(builder.add(wq, llvm_ir.Constant(_IR_I64, j)), llvm_ir.Constant(_IR_I64, 6))]
                    ),
                    _IR_V16I32.as_pointer(),
                ),
                align=1,
            )
            for j in range(nqg)
        ]
        out = []
        for r, rp in enumerate(rps):
            mask = builder.bitcast(_ir_code_word(builder, rp, b0, t), llvm_ir.VectorType(_IR_I1, 64))
            bits = builder.bitcast(builder.select(mask, ones, zeros), _IR_V16I32)
            for j, q in enumerate(qs):  # u8 (0/1) x s8 products, 4 per int32 lane
                out.append(builder.call(dpbusd, [accs[r * nqg + j], bits, q]))
        return out

    return _ir_word_loops(
        builder, nw, max(1, 4 // (nrows * nqg)), nrows * nqg, llvm_ir.Constant(_IR_V16I32, None), word, "vnni"
    )


def _ir_planes_dots(builder, rps, b0, nw, pp, qw0):
    """Per row pointer, ``Σ_{t<nw} Σ_b weight_b · popcount(word t & plane[8 (qw0 + t) + b])``
    spread over the 8 int64 lanes of a vector (lane ``b``: plane ``b``, weighted). The plane
    loads are shared by the rows."""
    nrows = len(rps)
    ctpop = _ir_fn(builder, "llvm.ctpop.v8i64", _IR_V8I64, [_IR_V8I64])
    undef = llvm_ir.Constant(_IR_V8I64, llvm_ir.Undefined)
    splat = llvm_ir.Constant(llvm_ir.VectorType(_IR_I32, 8), [0] * 8)
    weights = llvm_ir.Constant(_IR_V8I64, _PLANE_WEIGHTS)

    def word(t, accs):
        po = builder.shl(builder.add(qw0, t), llvm_ir.Constant(_IR_I64, 3))
        planes = builder.load(builder.bitcast(builder.gep(pp, [po]), _IR_V8I64.as_pointer()), align=8)
        out = []
        for rp, acc in zip(rps, accs):
            c = builder.insert_element(undef, _ir_code_word(builder, rp, b0, t), llvm_ir.Constant(_IR_I32, 0))
            c = builder.shuffle_vector(c, undef, splat)
            out.append(builder.add(acc, builder.call(ctpop, [builder.and_(c, planes)])))
        return out

    accs = _ir_word_loops(builder, nw, max(1, 2 // nrows), nrows, llvm_ir.Constant(_IR_V8I64, None), word, "planes")
    return [builder.mul(a, weights) for a in accs]


def _ir_word_loops(builder, nw, unroll, nrows, zero, word, name):
    """Run ``word(t, accs)`` for ``t < nw`` (``unroll`` words per step, then one at a time) with
    ``nrows`` accumulators per word slot; returns the per-row sums of the slots."""

    def step(t, v):
        return [
            x
            for j in range(unroll)
            for x in word(builder.add(t, llvm_ir.Constant(_IR_I64, j)), v[j * nrows : (j + 1) * nrows])
        ]

    t, acc = _ir_loop(builder, llvm_ir.Constant(_IR_I64, 0), nw, unroll, [zero] * (unroll * nrows), step, name + "u")
    if unroll > 1:
        t, head = _ir_loop(builder, t, nw, 1, acc[:nrows], lambda t, v: word(t, v), name + "1")
        acc = head + acc[nrows:]
    out = []
    for r in range(nrows):
        total = acc[r]
        for j in range(1, unroll):
            total = builder.add(total, acc[j * nrows + r])
        out.append(total)
    return out


def _ir_lane_sums(builder, vecs, lanes):
    """The lane sums of ``R`` vectors of ``lanes`` integers (``R`` a power of two up to ``lanes``),
    as one ``<R x int>`` vector: pairs of vectors are folded into one (half of each vector's
    lanes), then the lanes within each row's group."""

    def shuffle(x, y, idx):
        return builder.shuffle_vector(x, y, llvm_ir.Constant(llvm_ir.VectorType(_IR_I32, len(idx)), idx))

    vs, gs = list(vecs), lanes  # each vector holds groups of gs lanes, one group per row
    while len(vs) > 1:
        half = gs // 2
        nxt = []
        for x, y in zip(vs[0::2], vs[1::2]):
            ng = lanes // gs
            lo = [g * gs + o for g in range(ng) for o in range(half)]
            hi = [g * gs + half + o for g in range(ng) for o in range(half)]
            nxt.append(
                builder.add(shuffle(x, y, lo + [lanes + i for i in lo]), shuffle(x, y, hi + [lanes + i for i in hi]))
            )
        vs, gs = nxt, half
    v = vs[0]
    g0, size = gs, gs
    while size > 1:  # within each group, add the second half onto the first
        half = size // 2
        perm = [lane - lane % g0 + ((lane % g0) + half if lane % g0 < half else lane % g0) for lane in range(lanes)]
        v = builder.add(v, shuffle(v, v, perm))
        size = half
    return shuffle(v, v, [r * g0 for r in range(len(vecs))])


def _prescan_args_ok(buf, offs, pbuf, ahead, qarr, int8_only):
    if not (isinstance(offs, types.UniTuple) and offs.dtype == types.uint64 and offs.count in (1, 2, 4)):
        return False
    if not (isinstance(ahead, types.UniTuple) and ahead.dtype == types.uint64 and ahead.count == offs.count):
        return False
    for a in (buf, pbuf):
        if not (isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.uint8):
            return False
    dtypes = (types.int8,) if int8_only else (types.int8, types.uint64)
    return isinstance(qarr, types.Array) and qarr.ndim == 1 and qarr.dtype in dtypes


def _ir_prescan(context, builder, signature, args, nrows, nqg, vnni):
    """Codegen shared by :func:`_group_prescan` and :func:`_batch_prescan`: the module loop for
    ``nrows`` rows and ``nqg`` queries. Returns ``(approx, bound)``, ``<nrows·nqg x double>``
    vectors (row-major)."""
    bufv, offv, pbufv, aheadv, pf, qv, wsv, bov, c1v, c0v, errv, sv = args[:12]
    tys = signature.args
    f64 = llvm_ir.DoubleType()
    npair = nrows * nqg
    vf = llvm_ir.VectorType(f64, npair)
    base = _ir_data(context, builder, tys[0], bufv, _IR_I8)
    rps = [builder.gep(base, [builder.extract_value(offv, j)]) for j in range(nrows)]
    pbase = _ir_data(context, builder, tys[2], pbufv, _IR_I8)
    aps = [builder.gep(pbase, [builder.extract_value(aheadv, j)]) for j in range(nrows)]
    qp = _ir_data(context, builder, tys[5], qv, _IR_I8 if vnni else _IR_I64)
    wsp = _ir_data(context, builder, tys[6], wsv, _IR_I64)
    bop = _ir_data(context, builder, tys[7], bov, _IR_I64)
    c1p, c0p, errp, sp = (
        _ir_data(context, builder, tys[j], v, f64) for j, v in ((8, c1v), (9, c0v), (10, errv), (11, sv))
    )
    nmod = builder.sub(
        builder.extract_value(context.make_array(tys[6])(context, builder, wsv).shape, 0), llvm_ir.Constant(_IR_I64, 1)
    )
    pfn = _ir_fn(builder, "llvm.prefetch.p0", llvm_ir.VoidType(), [_IR_I8.as_pointer(), _IR_I32, _IR_I32, _IR_I32])
    one = llvm_ir.Constant(_IR_I64, 1)

    def spread(ptr, n, idx):
        """Load ``n`` doubles at ``ptr`` and lay them out as lanes ``idx``."""
        vn = llvm_ir.VectorType(f64, n)
        v = builder.load(builder.bitcast(ptr, vn.as_pointer()), align=8)
        return builder.shuffle_vector(
            v, llvm_ir.Constant(vn, llvm_ir.Undefined), llvm_ir.Constant(llvm_ir.VectorType(_IR_I32, npair), idx)
        )

    row_lanes = [r for r in range(nrows) for _ in range(nqg)]
    query_lanes = [j for _ in range(nrows) for j in range(nqg)]

    def module(u, vals):
        acc_a, acc_e = vals
        b0 = builder.load(builder.gep(bop, [u]))
        b1 = builder.load(builder.gep(bop, [builder.add(u, one)]))
        w0 = builder.load(builder.gep(wsp, [u]))
        nw = builder.sub(builder.load(builder.gep(wsp, [builder.add(u, one)])), w0)
        with builder.if_then(pf):

            def lines(o, _):
                for ap in aps:
                    builder.call(
                        pfn,
                        [
                            builder.gep(ap, [builder.add(b0, o)]),
                            llvm_ir.Constant(_IR_I32, 0),
                            llvm_ir.Constant(_IR_I32, 3),
                            llvm_ir.Constant(_IR_I32, 1),
                        ],
                    )
                return []

            _ir_loop_lt(builder, builder.sub(b1, b0), 64, lines, "pf")
        if vnni:
            dots = _ir_lane_sums(builder, _ir_vnni_dots(builder, rps, b0, nw, qp, w0, nqg), 16)
        else:
            dots = _ir_lane_sums(builder, _ir_planes_dots(builder, rps, b0, nw, qp, w0), 8)
        d = builder.sitofp(dots, vf)
        uq = builder.mul(u, llvm_ir.Constant(_IR_I64, nqg))
        s = spread(builder.gep(sp, [builder.mul(u, llvm_ir.Constant(_IR_I64, nrows))]), nrows, row_lanes)
        k1 = spread(builder.gep(c1p, [uq]), nqg, query_lanes)
        k0 = spread(builder.gep(c0p, [uq]), nqg, query_lanes)
        ke = spread(builder.gep(errp, [uq]), nqg, query_lanes)
        acc_a = builder.fadd(acc_a, builder.fmul(s, builder.fsub(builder.fmul(k1, d), k0)))
        acc_e = builder.fadd(acc_e, builder.fmul(s, ke))
        return [acc_a, acc_e]

    _, (acc_a, acc_e) = _ir_loop(
        builder,
        llvm_ir.Constant(_IR_I64, 0),
        nmod,
        1,
        [llvm_ir.Constant(vf, None), llvm_ir.Constant(vf, [_BOUND_TINY] * npair)],
        module,
        "mod",
    )
    return acc_a, acc_e


@intrinsic
def _group_prescan(typingctx, buf, offs, pbuf, ahead, prefetch, qrow, wstart, boff, c1, c0, err, sblk):
    """Approximate scores and bounds of ``R`` rows for one query (``R = len(offs)``, 1 or 4).

    The rows are at byte offsets ``offs`` of the 1-D uint8 ``buf``. ``qrow``: the query's int8
    integers (VNNI) or uint64 bit planes (see :func:`~.quantize._quantize_level`). ``wstart``, ``boff``:
    ``(U+1,)`` uint64. ``c1``, ``c0``, ``err``: ``(U,)`` float64 rows of the level.
    ``sblk``: ``(U, R)`` float64 scales, module-major. With ``prefetch``, module ``u``'s lines of
    the rows at offsets ``ahead`` of ``pbuf`` are prefetched while module ``u`` is scored.

    Returns ``R`` approximations ``Σ_u s_u (c1_u d_u - c0_u)`` then ``R`` bounds
    ``_BOUND_TINY + Σ_u s_u err_u`` (float64, module order: the same bits for every ``R``).
    """
    if not _prescan_args_ok(buf, offs, pbuf, ahead, qrow, False):
        return None
    nrows = offs.count
    vnni = qrow.dtype == types.int8
    sig = types.UniTuple(types.float64, 2 * nrows)(
        buf, offs, pbuf, ahead, types.boolean, qrow, wstart, boff, c1, c0, err, sblk
    )

    def codegen(context, builder, signature, args):
        acc_a, acc_e = _ir_prescan(context, builder, signature, args, nrows, 1, vnni)
        out = [builder.extract_element(v, llvm_ir.Constant(_IR_I32, j)) for v in (acc_a, acc_e) for j in range(nrows)]
        return context.make_tuple(builder, signature.return_type, out)

    return sig, codegen


@intrinsic
def _batch_prescan(typingctx, buf, offs, pbuf, ahead, prefetch, qgrp, wstart, boff, c1g, c0g, errg, sblk, res):
    """:func:`_group_prescan` for ``R`` rows and a group of :data:`_QUERY_SET` queries (VNNI only).

    ``qgrp``: the group's int8 integers interleaved per word, ``[(w·Q + j)·64 + i]``.
    ``c1g``, ``c0g``, ``errg``: ``(U, Q)`` float64. Writes ``res[r·Q + j]`` (approximation of row
    ``r`` for query ``j``) and ``res[R·Q + r·Q + j]`` (its bound); ``res`` float64 ``(>= 2RQ,)``.
    Each expanded code word feeds the ``Q`` queries and each query load the ``R`` rows.
    """
    if not _prescan_args_ok(buf, offs, pbuf, ahead, qgrp, True):
        return None
    nrows = offs.count
    sig = types.void(buf, offs, pbuf, ahead, types.boolean, qgrp, wstart, boff, c1g, c0g, errg, sblk, res)

    def codegen(context, builder, signature, args):
        acc_a, acc_e = _ir_prescan(context, builder, signature, args, nrows, _QUERY_SET, True)
        vf = acc_a.type
        rp = _ir_data(context, builder, signature.args[12], args[12], llvm_ir.DoubleType())
        builder.store(acc_a, builder.bitcast(rp, vf.as_pointer()), align=8)
        builder.store(
            acc_e,
            builder.bitcast(builder.gep(rp, [llvm_ir.Constant(_IR_I64, nrows * _QUERY_SET)]), vf.as_pointer()),
            align=8,
        )
        return context.get_dummy_value()

    return sig, codegen


def _ir_loop_lt(builder, stop, step, body, name):
    """``for o = 0; o < stop; o += step: body(o)`` (``stop`` int64, may be 0)."""
    pre = builder.block
    head = builder.append_basic_block(name + ".head")
    loop = builder.append_basic_block(name + ".body")
    done = builder.append_basic_block(name + ".done")
    builder.branch(head)
    builder.position_at_end(head)
    o = builder.phi(_IR_I64)
    o.add_incoming(llvm_ir.Constant(_IR_I64, 0), pre)
    builder.cbranch(builder.icmp_unsigned("<", o, stop), loop, done)
    builder.position_at_end(loop)
    body(o, [])
    o.add_incoming(builder.add(o, llvm_ir.Constant(_IR_I64, step)), builder.block)
    builder.branch(head)
    builder.position_at_end(done)


def _host_has_vnni() -> bool:
    """Whether numba compiles for this very CPU (no ``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``
    override) and that CPU has AVX512-VNNI (with AVX512F/BW), i.e. the int8 form can run."""
    import numba
    from llvmlite import binding

    if numba.config.CPU_NAME is not None or numba.config.CPU_FEATURES is not None:
        return False
    try:
        feats = binding.get_host_cpu_features()
    except Exception:  # pragma: no cover - feature query unavailable
        return False
    return all(feats.get(f, False) for f in ("avx512f", "avx512bw", "avx512vnni"))
