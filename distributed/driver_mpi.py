"""MPI calls a compiled driver makes itself: start a bucket's non-blocking allreduce at the plan
step that finishes the bucket, and test the started ones between later kernels (MPICH moves a
non-blocking collective along only inside MPI calls).

The driver cannot hold MPI objects, and a compiled function calling a ctypes function cannot be
cached on disk (Numba bakes the address in). So every address lives in one int64 array, the
exchange table, filled per call by Python (`fill_table`): the MPI functions' entry points, the
communicator, datatype and operation handles, each bucket's buffer and element count, and slots
MPI writes the requests and flags into. The functions here call through those addresses
(`_call`, an intrinsic), so they and the drivers calling them cache like any other.

Table layout: HEADER slots, then BUCKET_SLOTS per bucket (see the *_AT offsets)."""

from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

# header
IALLREDUCE_AT, TEST_AT, WAIT_AT, COMM_AT, SUM_AT, IN_PLACE_AT, BUCKETS_AT = range(7)
STATUS_AT = 8  # 8 slots (64 bytes) MPI may write a status into; nobody reads it
HEADER = 16
# per bucket, from HEADER + k * BUCKET_SLOTS
ADDRESS, COUNT, DATATYPE, STATE, REQUEST, FLAG, ERROR, OP = range(8)
BUCKET_SLOTS = 8
IDLE, STARTED, DONE = 0, 1, 2  # STATE


def _handle_type(bits: int) -> ir.IntType:
    return ir.IntType(bits)


@intrinsic
def _call(typingctx, address, arguments, kinds):
    """address(*arguments) -> int32 (an MPI error code). arguments: a tuple of int64; kinds, a
    literal string, says what each is: 'p' a pointer, 'i' a C int, 'h' an MPI handle of 4
    bytes (an int: MPICH), 'q' one of 8 (a pointer: Open MPI). The widths are letters, not a
    global, because Numba's disk cache keeps a compiled function whatever a global held when
    it compiled (a driver build process, which never loads MPI, compiles these too)."""
    if not isinstance(kinds, types.StringLiteral):
        return None
    letters = kinds.literal_value
    sig = types.int32(address, arguments, kinds)

    def codegen(context, builder, signature, args):
        address_value, tuple_value, _ = args
        pointer = ir.IntType(8).as_pointer()
        widths = {"p": pointer, "i": ir.IntType(32), "h": ir.IntType(32), "q": ir.IntType(64)}
        argument_types = [widths[k] for k in letters]
        function_type = ir.FunctionType(ir.IntType(32), argument_types)
        function = builder.inttoptr(address_value, function_type.as_pointer())
        values = []
        for i, kind in enumerate(letters):
            value = builder.extract_value(tuple_value, i)
            if kind == "p":
                values.append(builder.inttoptr(value, pointer))
            elif argument_types[i].width < 64:
                values.append(builder.trunc(value, argument_types[i]))
            else:
                values.append(value)
        return builder.call(function, values)

    return sig, codegen


@njit(nogil=True, cache=True)
def _started(table, at, error):
    table[at + ERROR] = error
    table[at + STATE] = STARTED if error == 0 else DONE


@njit(nogil=True, cache=True)
def _iallreduce_arguments(table, k):
    at = HEADER + k * BUCKET_SLOTS
    table[at + REQUEST] = 0
    return at, (
        table[IN_PLACE_AT],
        table[at + ADDRESS],
        table[at + COUNT],
        table[at + DATATYPE],
        table[at + OP],
        table[COMM_AT],
        table.ctypes.data + 8 * (at + REQUEST),
    )


@njit(nogil=True, cache=True)
def dp_start(table, k):
    """Start bucket k's in-place sum over the communicator (MPI_Iallreduce); MPI handles of 4
    bytes (MPICH and its derivatives)."""
    at, arguments = _iallreduce_arguments(table, k)
    _started(table, at, _call(table[IALLREDUCE_AT], arguments, "ppihhhp"))


@njit(nogil=True, cache=True)
def dp_start_wide(table, k):
    """dp_start for MPI handles of 8 bytes (Open MPI's are pointers)."""
    at, arguments = _iallreduce_arguments(table, k)
    _started(table, at, _call(table[IALLREDUCE_AT], arguments, "ppiqqqp"))


def start_function(handle_bytes: int) -> str:
    """The name of the dp_start variant for this MPI's handle width."""
    if handle_bytes not in (4, 8):
        raise OSError(f"this MPI's handles are {handle_bytes} bytes: no calls from the driver")
    return "dp_start" if handle_bytes == 4 else "dp_start_wide"


def handle_bytes() -> int:
    """The width of this MPI's handles (communicator, datatype and operation alike)."""
    from mpi4py import MPI

    width = MPI._sizeof(MPI.Comm)
    if not (MPI._sizeof(MPI.Datatype) == MPI._sizeof(MPI.Op) == width):
        raise OSError("this MPI's handles differ in size: no calls from the driver")
    return width


@njit(nogil=True, cache=True)
def dp_test(table, k) -> bool:
    """MPI_Test on bucket k's request: True once its sum is complete (or it never started)."""
    at = HEADER + k * BUCKET_SLOTS
    if table[at + STATE] != STARTED:
        return True
    base = table.ctypes.data
    table[at + FLAG] = 0
    error = _call(
        table[TEST_AT],
        (base + 8 * (at + REQUEST), base + 8 * (at + FLAG), base + 8 * STATUS_AT),
        "ppp",
    )
    if error != 0:
        table[at + ERROR] = error
        table[at + STATE] = DONE
        return True
    if table[at + FLAG] & 0xFFFFFFFF:
        table[at + STATE] = DONE
        return True
    return False


@njit(nogil=True, cache=True)
def dp_progress(table):
    """Test every started bucket once: MPI moves them along inside the call."""
    for k in range(table[BUCKETS_AT]):
        if table[HEADER + k * BUCKET_SLOTS + STATE] == STARTED:
            dp_test(table, k)


@njit(nogil=True, cache=True)
def dp_wait(table, k):
    """Block in MPI_Wait until bucket k's sum is complete."""
    at = HEADER + k * BUCKET_SLOTS
    if table[at + STATE] != STARTED:
        return
    base = table.ctypes.data
    error = _call(table[WAIT_AT], (base + 8 * (at + REQUEST), base + 8 * STATUS_AT), "pp")
    if error != 0:
        table[at + ERROR] = error
    table[at + STATE] = DONE


def mpi_library() -> ctypes.CDLL:
    """The MPI library mpi4py loaded (found among this process's mapped files), for the
    addresses of its functions."""
    from mpi4py import MPI  # noqa: F401 - loads the library

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/libmpi" in line}
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if name.startswith(("libmpi.so", "libmpi_")) or name.startswith("libmpich"):
            return ctypes.CDLL(path)
    raise OSError("no MPI library (libmpi.so) is mapped in this process")


class TableMaker:
    """Fills exchange tables for one communicator."""

    def __init__(self, comm):
        from mpi4py import MPI

        self.start = start_function(handle_bytes())  # the hooked driver's dp_start
        library = mpi_library()
        address = lambda name: ctypes.cast(getattr(library, name), ctypes.c_void_p).value  # noqa: E731
        self.header = np.zeros(HEADER, np.int64)
        self.header[IALLREDUCE_AT] = address("MPI_Iallreduce")
        self.header[TEST_AT] = address("MPI_Test")
        self.header[WAIT_AT] = address("MPI_Wait")
        self.header[COMM_AT] = MPI._handleof(comm)
        self.header[SUM_AT] = MPI._handleof(MPI.SUM)
        self.header[IN_PLACE_AT] = int(MPI.IN_PLACE)
        self.datatypes = {
            np.dtype(np.float32): MPI._handleof(MPI.FLOAT),
            np.dtype(np.float64): MPI._handleof(MPI.DOUBLE),
        }
        self._uint16 = MPI._handleof(MPI.UINT16_T)

    def table(self, buffers: list[np.ndarray], half_ops=None) -> np.ndarray:
        """A table for these bucket buffers (1-D, C-contiguous, kept alive by the caller): each
        summed by MPI_SUM, a 16-bit one as its bit patterns (uint16) by half_ops[its dtype]
        (mpi4py Ops of half_sum.py)."""
        from mpi4py import MPI

        table = np.zeros(HEADER + BUCKET_SLOTS * len(buffers), np.int64)
        table[:HEADER] = self.header
        table[BUCKETS_AT] = len(buffers)
        for k, buffer in enumerate(buffers):
            at = HEADER + k * BUCKET_SLOTS
            table[at + ADDRESS] = buffer.ctypes.data
            table[at + COUNT] = buffer.size
            if buffer.dtype in self.datatypes:
                table[at + DATATYPE] = self.datatypes[buffer.dtype]
                table[at + OP] = self.header[SUM_AT]
            else:  # bfloat16 or float16 (in_plan.py starts no other dtype inside)
                table[at + DATATYPE] = self._uint16
                table[at + OP] = _signed(MPI._handleof(half_ops[buffer.dtype]))
        return table


def _signed(handle: int) -> int:
    """An MPI handle as the int64 of its bits (mpi4py gives a user operation's MPICH handle,
    a negative int, as an unsigned 64-bit number)."""
    return handle - (1 << 64) if handle >= 1 << 63 else handle
