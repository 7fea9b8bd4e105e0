//! The device buffers of a batch check over GPU memory
//! (`kvsan_check_*_device`): addresses and lengths, as the C calls give
//! them; checked by `calls`, used by `device` (feature `cuda`).

/// An engine's device buffers for one check: device addresses and lengths
/// (in values).
#[derive(Clone, Copy, Debug)]
// Without the `cuda` feature only the addresses are looked at.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum DeviceBuffers {
    /// `block_table[table_len]` in rows of `stride`, `seq_lens[rows]`.
    BlockTable {
        block_table: u64,
        table_len: usize,
        stride: usize,
        seq_lens: u64,
    },
    /// `indptr[rows + 1]`, `indices[nnz]`, `last_page_len[rows]`.
    PagedCsr {
        indptr: u64,
        indices: u64,
        nnz: usize,
        last_page_len: u64,
    },
    /// `req_to_token[table_len]` in rows of `stride`, `req_indices[rows]`,
    /// `seq_lens[rows]`.
    ReqToToken {
        req_to_token: u64,
        table_len: usize,
        stride: usize,
        req_indices: u64,
        seq_lens: u64,
    },
    /// `query_start_loc[rows + 1]`, `slot_mapping[tokens]` (i64).
    SlotMapping {
        query_start_loc: u64,
        slot_mapping: u64,
        tokens: usize,
    },
}

impl DeviceBuffers {
    /// Each buffer: its name, address, length in values and value size.
    pub(crate) fn arrays(&self, rows: usize) -> Vec<(&'static str, u64, usize, usize)> {
        let offsets = rows.saturating_add(1);
        match *self {
            DeviceBuffers::BlockTable {
                block_table,
                table_len,
                seq_lens,
                ..
            } => vec![
                ("block_table", block_table, table_len, 4),
                ("seq_lens", seq_lens, rows, 4),
            ],
            DeviceBuffers::PagedCsr {
                indptr,
                indices,
                nnz,
                last_page_len,
            } => vec![
                ("indptr", indptr, offsets, 4),
                ("indices", indices, nnz, 4),
                ("last_page_len", last_page_len, rows, 4),
            ],
            DeviceBuffers::ReqToToken {
                req_to_token,
                table_len,
                req_indices,
                seq_lens,
                ..
            } => vec![
                ("req_to_token", req_to_token, table_len, 4),
                ("req_indices", req_indices, rows, 4),
                ("seq_lens", seq_lens, rows, 4),
            ],
            DeviceBuffers::SlotMapping {
                query_start_loc,
                slot_mapping,
                tokens,
            } => vec![
                ("query_start_loc", query_start_loc, offsets, 4),
                ("slot_mapping", slot_mapping, tokens, 8),
            ],
        }
    }
}

/// The CUDA device ordinal `device` (a C `int32_t`), refused if negative.
pub(crate) fn device_ordinal(
    call: &'static str,
    device: i32,
) -> Result<usize, crate::error::ShimError> {
    usize::try_from(device).map_err(|_| crate::error::ShimError::InvalidArgument {
        call,
        argument: "device",
        value: device as u64,
        allowed: "a CUDA device ordinal, 0 or more",
    })
}
