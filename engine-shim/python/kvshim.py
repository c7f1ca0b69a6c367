"""kvshim.py — ctypes binding of libkvshim (engine-shim/kvshim.h), no third-party dependency.

    from array import array
    import kvshim
    with kvshim.Shim("ipc:///run/kvd/kvd.sock") as s:
        seq, cached = s.begin(prompt)            # prompt: list of ints / array('I')
        seq.extend(prompt[cached:])
        for layer in range(s.geom.layers):
            seq.append(layer, k, v)              # k, v: [m][kv_heads][head_dim]
        seq.commit()
        out = s.attention([seq], layer, q, q_heads=32)   # array('f') [nseq][q_heads][head_dim]
        seq.end()

Tensors: on the host backend any C-contiguous buffer-protocol object (array('f'), bytes,
bytearray, memoryview, a numpy array) of the right size; its element type comes from `dtype`
('f32', 'f16', 'bf16'), or from the buffer's format ('f' float32, 'e' float16) when dtype is
None. On a device backend (Shim.on_device) pass device addresses as ints (e.g. a torch
tensor's data_ptr()) or objects with __cuda_array_interface__, dtype 'f16' or 'bf16', and an
`out` device address to attention.

The library: the `lib` argument, else $KVSHIM_LIB, else libkvshim.so beside this file, else the
dynamic linker's search path. Errors raise KvsError(code, name, message) with the shim's words;
arguments ctypes would silently truncate (a layer or q_heads outside 0..2**32-1, negative token
ids, an unknown dtype) raise ValueError before the call.
Thread rule: one Shim per thread (as kvs_t). A Shim is not usable in a process forked after it
was opened (ZeroMQ); open one per process.
"""

import ctypes
import ctypes.util
import operator
import os
from array import array

__all__ = ["Shim", "Seq", "KvsError", "Geom", "F32", "F16", "BF16"]

F32, F16, BF16 = 0, 1, 2
_DTYPES = {"f32": F32, "float32": F32, "f16": F16, "float16": F16, "bf16": BF16,
           "bfloat16": BF16, F32: F32, F16: F16, BF16: BF16}
_ITEMSIZE = {F32: 4, F16: 2, BF16: 2}
_FORMATS = {"f": F32, "e": F16}
_U32_MAX = 2**32 - 1


class KvsError(Exception):
    """A libkvshim call failed: code (kv_err_t), name ("INVALID_ARGUMENT"), message."""

    def __init__(self, code, name, message):
        super().__init__(f"{name}: {message}")
        self.code, self.name, self.message = code, name, message


class Geom(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_uint32), ("kv_heads", ctypes.c_uint32),
                ("head_dim", ctypes.c_uint32), ("page_tokens", ctypes.c_uint32),
                ("seed", ctypes.c_uint64)]

    def __repr__(self):
        return (f"Geom(layers={self.layers}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}, page_tokens={self.page_tokens})")


class _Opts(ctypes.Structure):
    _fields_ = [("endpoint", ctypes.c_char_p), ("ns", ctypes.c_char_p),
                ("name", ctypes.c_char_p), ("timeout_ms", ctypes.c_int)]


_P = ctypes.c_void_p
_U32P = ctypes.POINTER(ctypes.c_uint32)
_SIZE = ctypes.c_size_t


def _load(path=None):
    cands = [path, os.environ.get("KVSHIM_LIB"),
             os.path.join(os.path.dirname(os.path.abspath(__file__)), "libkvshim.so"),
             ctypes.util.find_library("kvshim")]
    for c in cands:
        if c and (os.path.sep not in c or os.path.exists(c)):
            lib = ctypes.CDLL(c)
            break
    else:
        raise OSError("libkvshim.so not found: pass lib=, set KVSHIM_LIB, or install it")
    sig = {
        "kvs_open": (ctypes.c_int, [ctypes.POINTER(_P), ctypes.POINTER(_Opts)]),
        "kvs_close": (None, [ctypes.POINTER(_P)]),
        "kvs_errmsg": (ctypes.c_char_p, [_P]),
        "kvs_geom": (ctypes.POINTER(Geom), [_P]),
        "kvs_on_device": (ctypes.c_int, [_P]),
        "kvs_seq_begin": (ctypes.c_int, [_P, _U32P, _SIZE, ctypes.POINTER(_P),
                                         ctypes.POINTER(_SIZE)]),
        "kvs_seq_extend": (ctypes.c_int, [_P, _U32P, _SIZE]),
        "kvs_append": (ctypes.c_int, [_P, ctypes.c_uint32, _P, _P, ctypes.c_int, _SIZE]),
        "kvs_append_batch": (ctypes.c_int, [_P, ctypes.POINTER(_P), _SIZE, ctypes.c_uint32, _P,
                                            _P, ctypes.c_int, _SIZE]),
        "kvs_seq_commit": (ctypes.c_int, [_P]),
        "kvs_seq_len": (_SIZE, [_P]),
        "kvs_seq_pages": (_SIZE, [_P, _U32P, _SIZE]),
        "kvs_attention": (ctypes.c_int, [_P, ctypes.POINTER(_P), _SIZE, ctypes.c_uint32,
                                         ctypes.c_uint32, _P, ctypes.c_float, _P]),
        "kvs_seq_end": (ctypes.c_int, [ctypes.POINTER(_P)]),
        "kv_err_name": (ctypes.c_char_p, [ctypes.c_int]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib


def _u32(tokens, what, empty="no tokens"):
    """tokens as a contiguous uint32 array (no copy for array('I') of 4-byte items); an empty
    one (`empty` says why that is wrong) or an id outside uint32 is a ValueError naming
    `what`, not array's OverflowError or the shim's "tokens is NULL"."""
    if isinstance(tokens, array) and tokens.typecode == "I" and tokens.itemsize == 4:
        a = tokens
    else:
        if not isinstance(tokens, (list, tuple, range)):
            tokens = list(tokens)  # an iterator: the error path below reads it again
        try:
            a = array("I", tokens)
        except OverflowError:
            i, t = next((i, t) for i, t in enumerate(tokens) if not 0 <= t <= _U32_MAX)
            raise ValueError(f"{what}: token id {t} at index {i} is outside 0..2**32-1") from None
    if len(a) == 0:
        raise ValueError(f"{what}: {empty}")
    if a.itemsize != 4:
        raise TypeError("array('I') is not 4 bytes on this platform")
    addr, n = a.buffer_info()
    return a, ctypes.cast(addr, _U32P), n


def _uint(value, what, limit=None):
    """value as an int in 0..2**32-1 (and below limit when given), else ValueError: a ctypes
    c_uint32 argument would silently keep the low 32 bits (layer 2**32 wrote layer 0)."""
    try:
        value = operator.index(value)  # ints, numpy integers; not floats
    except TypeError:
        raise TypeError(f"{what} is {type(value).__name__}, not an integer") from None
    top = _U32_MAX if limit is None else limit - 1
    if not 0 <= value <= top:
        raise ValueError(f"{what} = {value} is outside 0..{top}")
    return value


def _dtype(dtype):
    """kvs_dtype_t of a dtype name or constant; ValueError naming the accepted ones."""
    try:
        return _DTYPES[dtype]
    except (KeyError, TypeError):
        names = ", ".join(repr(k) for k in _DTYPES if isinstance(k, str))
        raise ValueError(f"dtype {dtype!r}: one of {names} (or kvshim.F32, F16, BF16)") from None


def _dev_ptr(obj):
    if isinstance(obj, int):
        return obj
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return cai["data"][0]
    return None


def _host_buf(obj, writable):
    """(address, nbytes, format, keepalive) of a C-contiguous buffer."""
    mv = memoryview(obj)
    if not mv.c_contiguous:
        raise ValueError("the buffer is not C-contiguous")
    fmt = mv.format
    if mv.readonly:
        if writable:
            raise ValueError("the output buffer is read-only")
        keep = bytes(mv) if not isinstance(obj, bytes) else obj
        return ctypes.cast(ctypes.c_char_p(keep), _P).value, len(keep), fmt, keep
    raw = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
    cbuf = (ctypes.c_char * raw.nbytes).from_buffer(raw)
    return ctypes.addressof(cbuf), raw.nbytes, fmt, (cbuf, raw)


def _kv_bufs(on_device, k, v, dtype):
    """(k address, v address, kvs_dtype_t, k bytes, v bytes, keepalive) of an append's K/V:
    device addresses (bytes None; dtype default f16) or host buffers (dtype from the buffer
    format unless given)."""
    if on_device:
        ka, va = _dev_ptr(k), _dev_ptr(v)
        if ka is None or va is None:
            raise TypeError("device backend: k and v must be device addresses")
        return ka, va, _dtype(dtype if dtype is not None else "f16"), None, None, None
    ka, kb, kf, kk = _host_buf(k, False)
    va, vb, _, vk = _host_buf(v, False)
    if dtype is None:
        if kf not in _FORMATS:
            raise TypeError(f"buffer format {kf!r}: give dtype ('f32', 'f16', 'bf16')")
        dt = _FORMATS[kf]
    else:
        dt = _dtype(dtype)
    return ka, va, dt, kb, vb, (kk, vk)


class Shim:
    """One libkvshim session (kvs_t): a connection to the daemon and its mapped pools."""

    def __init__(self, endpoint, ns=None, name=None, timeout_ms=0, lib=None):
        self._lib = _load(lib)
        self._s = _P()
        o = _Opts(endpoint.encode(), ns.encode() if ns else None,
                  name.encode() if name else None, int(timeout_ms))
        e = self._lib.kvs_open(ctypes.byref(self._s), ctypes.byref(o))
        if e:
            self._raise(e, None)
        g = self._lib.kvs_geom(self._s).contents
        self.geom = Geom(g.layers, g.kv_heads, g.head_dim, g.page_tokens, g.seed)
        self.on_device = bool(self._lib.kvs_on_device(self._s))
        self._seqs = set()

    def _raise(self, code, handle):
        msg = self._lib.kvs_errmsg(handle).decode(errors="replace")
        raise KvsError(code, self._lib.kv_err_name(code).decode(), msg)

    def _check(self, code):
        if code:
            self._raise(code, self._s)

    def _live(self):
        if not self._s:
            raise ValueError("the Shim is closed")

    def begin(self, tokens):
        """Start a sequence for a prompt: (Seq, cached) — the first `cached` tokens come from
        the prefix cache; compute K/V from there on (Seq.extend(tokens[cached:]))."""
        self._live()
        _, ptr, n = _u32(tokens, "begin", "empty prompt (a sequence starts with a token)")
        q, cached = _P(), _SIZE()
        self._check(self._lib.kvs_seq_begin(self._s, ptr, n, ctypes.byref(q),
                                            ctypes.byref(cached)))
        seq = Seq(self, q)
        self._seqs.add(seq)
        return seq, cached.value

    def attention(self, seqs, layer, q, q_heads, sm_scale=0.0, out=None):
        """Decode attention, one query per sequence: q [nseq][q_heads][head_dim] float32.
        Returns out (array('f') on the host unless given)."""
        self._live()
        _uint(layer, "layer", self.geom.layers)
        _uint(q_heads, "q_heads")
        seqs = list(seqs)
        for sq in seqs:
            if not isinstance(sq, Seq) or sq._shim is not self or not sq._q:
                raise ValueError("attention takes open sequences of this Shim")
        n_out = len(seqs) * q_heads * self.geom.head_dim
        handles = (_P * max(1, len(seqs)))(*[sq._q for sq in seqs])
        if self.on_device:
            qa, oa = _dev_ptr(q), _dev_ptr(out)
            if qa is None or oa is None:
                raise TypeError("device backend: q and out must be device addresses")
            keep = None
        else:
            qa, qbytes, _, keep = _host_buf(q, False)
            if qbytes != 4 * n_out:
                raise ValueError(f"q has {qbytes} bytes, expected {4 * n_out} "
                                 f"([{len(seqs)}][{q_heads}][{self.geom.head_dim}] float32)")
            if out is None:
                out = array("f", bytes(4 * n_out))
            oa, obytes, _, okeep = _host_buf(out, True)
            if obytes != 4 * n_out:
                raise ValueError(f"out has {obytes} bytes, expected {4 * n_out}")
            keep = (keep, okeep)
        self._check(self._lib.kvs_attention(self._s, handles, len(seqs), layer, q_heads, qa,
                                            float(sm_scale), oa))
        del keep
        return out

    def append_batch(self, seqs, layer, k, v, dtype=None, m=1):
        """K/V of the first m tokens of each sequence's last extend, for one layer, in one call
        (kvs_append_batch: one kernel launch on device pools): k, v [nseq][m][kv_heads]
        [head_dim] in the order of seqs. m = 1 is a decode step. All or nothing."""
        self._live()
        g = self.geom
        _uint(layer, "layer", g.layers)
        _uint(m, "m")
        seqs = list(seqs)
        for sq in seqs:
            if not isinstance(sq, Seq) or sq._shim is not self or not sq._q:
                raise ValueError("append_batch takes open sequences of this Shim")
        handles = (_P * max(1, len(seqs)))(*[sq._q for sq in seqs])
        ka, va, dt, kb, vb, keep = _kv_bufs(self.on_device, k, v, dtype)
        if not self.on_device:
            need = len(seqs) * m * g.kv_heads * g.head_dim * _ITEMSIZE[dt]
            if kb != need or vb != need:
                raise ValueError(f"k and v must be [{len(seqs)}][{m}][{g.kv_heads}]"
                                 f"[{g.head_dim}]: {need} bytes each, got {kb} and {vb}")
        self._check(self._lib.kvs_append_batch(self._s, handles, len(seqs), layer, ka, va, dt,
                                               m))
        del keep

    def close(self):
        """End every open sequence and the session (idempotent)."""
        if self._s:
            for sq in list(self._seqs):
                sq._q = None  # freed by kvs_close
            self._seqs.clear()
            self._lib.kvs_close(ctypes.byref(self._s))
            self._s = _P()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Seq:
    """A sequence (kvs_seq_t): block table and token ids. Made by Shim.begin."""

    def __init__(self, shim, q):
        self._shim, self._q = shim, q

    def _h(self):
        if not self._q:
            raise ValueError("the sequence has ended")
        return self._q

    def extend(self, tokens):
        """Room for more tokens (their ids)."""
        _, ptr, n = _u32(tokens, "extend")
        self._shim._check(self._shim._lib.kvs_seq_extend(self._h(), ptr, n))

    def append(self, layer, k, v, dtype=None, m=None):
        """K/V of the tokens of the last extend for one layer: [m][kv_heads][head_dim]."""
        h = self._h()
        g = self._shim.geom
        _uint(layer, "layer", g.layers)
        if m is not None:
            _uint(m, "m")
        row = g.kv_heads * g.head_dim
        ka, va, dt, kb, vb, keep = _kv_bufs(self._shim.on_device, k, v, dtype)
        if self._shim.on_device:
            if m is None:
                raise ValueError("device backend: give m")
        else:
            per = row * _ITEMSIZE[dt]
            if kb != vb or kb % per:
                raise ValueError(f"k and v must be [m][{g.kv_heads}][{g.head_dim}] of the same "
                                 f"size ({kb} and {vb} bytes)")
            if m is None:
                m = kb // per
            elif m * per != kb:
                raise ValueError(f"k has {kb} bytes, m = {m} needs {m * per}")
        self._shim._check(self._shim._lib.kvs_append(h, layer, ka, va, dt, m))
        del keep

    def commit(self):
        """Seal the pages that became full (they enter the prefix cache)."""
        self._shim._check(self._shim._lib.kvs_seq_commit(self._h()))

    def __len__(self):
        return self._shim._lib.kvs_seq_len(self._h())

    def pages(self):
        """The block table: array('I') of logical page ids."""
        h = self._h()
        n = self._shim._lib.kvs_seq_pages(h, None, 0)
        a = array("I", bytes(4 * n))
        if n:
            self._shim._lib.kvs_seq_pages(h, ctypes.cast(a.buffer_info()[0], _U32P), n)
        return a

    def end(self):
        """Release the sequence (sealed pages stay cached). Idempotent. The handle is freed
        either way; KvsError when the daemon did not confirm (the daemon then drops the
        sequence when the session ends)."""
        if self._q:
            e = self._shim._lib.kvs_seq_end(ctypes.byref(self._q))
            self._shim._seqs.discard(self)
            self._q = None
            self._shim._check(e)
