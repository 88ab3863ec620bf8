"""The Triton kernel of :mod:`.triton_sums` (defined only where Triton imports: a GPU build of torch)."""

# Triton reads the kernel's source and its module's globals: no annotations but ``tl.constexpr``, ``tl`` global.
# mypy: disallow-untyped-defs=False

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch ships no Triton: the module is empty
    triton = None

if triton is not None:

    @triton.jit
    def fingerprint_sums(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        """Add ``sum(v_i)`` and ``sum((i + 1) * v_i)`` (int64, wrapping) of ``n`` integers at ``x_ptr`` into
        ``out_ptr[0:2]``, ``BLOCK`` elements per program."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int64)
        tl.atomic_add(out_ptr, tl.sum(v, axis=0))
        tl.atomic_add(out_ptr + 1, tl.sum(v * (offs + 1), axis=0))
