//! The payload's fields: a writer and a bounds-checked reader of the
//! encodings the module doc lists.

use super::WireError;
use super::frame::malformed;
use super::{FrameHeader, type_name};
use kvsan_sanitizer::{Owner, PageRef, RequestId, TenantId};

/// Appends little-endian fields.
pub(super) struct Put<'a>(pub(super) &'a mut Vec<u8>);

impl Put<'_> {
    pub(super) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(super) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn usize(&mut self, v: usize) {
        self.u64(v as u64);
    }
    pub(super) fn f32(&mut self, v: f32) {
        self.u32(v.to_bits());
    }
    /// A count; one beyond `u32` makes the frame too large, which
    /// [`frame_head`] reports, so saturating here loses nothing.
    pub(super) fn count(&mut self, n: usize) {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX));
    }
    pub(super) fn str(&mut self, s: &str) {
        self.count(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }
    pub(super) fn owner(&mut self, o: Owner) {
        self.u64(o.request.0);
        self.u32(o.tenant.0);
    }
    pub(super) fn pages(&mut self, pages: &[PageRef]) {
        self.count(pages.len());
        for p in pages {
            self.u32(p.page.0);
            self.u32(p.generation.0);
        }
    }
    pub(super) fn tokens(&mut self, tokens: &[u32]) {
        self.count(tokens.len());
        for &t in tokens {
            self.u32(t);
        }
    }
    pub(super) fn u64s(&mut self, values: &[u64]) {
        self.count(values.len());
        for &v in values {
            self.u64(v);
        }
    }
}

/// Reads little-endian fields, every read checked against what remains.
pub(super) struct Take<'a> {
    buf: &'a [u8],
    pos: usize,
    header: &'a FrameHeader,
}

impl<'a> Take<'a> {
    pub(super) fn new(buf: &'a [u8], header: &'a FrameHeader) -> Self {
        Take {
            buf,
            pos: 0,
            header,
        }
    }

    pub(super) fn err(&self, field: &'static str, what: String) -> WireError {
        malformed(self.header, field, what)
    }

    pub(super) fn bytes(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], WireError> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(self.err(
                field,
                format!("needs {n} bytes at offset {}, only {left} remain", self.pos),
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub(super) fn array<const N: usize>(
        &mut self,
        field: &'static str,
    ) -> Result<[u8; N], WireError> {
        let s = self.bytes(N, field)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    pub(super) fn u8(&mut self, field: &'static str) -> Result<u8, WireError> {
        Ok(self.array::<1>(field)?[0])
    }
    pub(super) fn u32(&mut self, field: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }
    pub(super) fn u64(&mut self, field: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }
    pub(super) fn usize(&mut self, field: &'static str) -> Result<usize, WireError> {
        let v = self.u64(field)?;
        usize::try_from(v)
            .map_err(|_| self.err(field, format!("{v} does not fit this machine's usize")))
    }
    pub(super) fn f32(&mut self, field: &'static str) -> Result<f32, WireError> {
        Ok(f32::from_bits(self.u32(field)?))
    }

    /// A count of items of `item_bytes` each, checked against what remains
    /// before anything is allocated for them.
    pub(super) fn count(
        &mut self,
        item_bytes: usize,
        field: &'static str,
    ) -> Result<usize, WireError> {
        let n = self.u32(field)? as usize;
        let left = self.buf.len() - self.pos;
        if n.saturating_mul(item_bytes) > left {
            return Err(self.err(
                field,
                format!(
                    "{n} items of {item_bytes} bytes do not fit in the {left} bytes that remain"
                ),
            ));
        }
        Ok(n)
    }

    pub(super) fn str(&mut self, field: &'static str) -> Result<String, WireError> {
        let n = self.count(1, field)?;
        let b = self.bytes(n, field)?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(s.to_string()),
            // The text itself is not repeated: it may be anything.
            Err(e) => Err(self.err(
                field,
                format!(
                    "{n} bytes are not UTF-8 (invalid at byte {})",
                    e.valid_up_to()
                ),
            )),
        }
    }

    pub(super) fn flag(&mut self, field: &'static str) -> Result<bool, WireError> {
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(self.err(field, format!("option tag {v}, expected 0 or 1"))),
        }
    }

    pub(super) fn owner(&mut self, field: &'static str) -> Result<Owner, WireError> {
        Ok(Owner {
            request: RequestId(self.u64(field)?),
            tenant: TenantId(self.u32(field)?),
        })
    }

    pub(super) fn pages(&mut self, field: &'static str) -> Result<Vec<PageRef>, WireError> {
        let n = self.count(8, field)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let page = self.u32(field)?;
            let generation = self.u32(field)?;
            v.push(PageRef::new(page, generation));
        }
        Ok(v)
    }

    pub(super) fn tokens(&mut self, field: &'static str) -> Result<Vec<u32>, WireError> {
        let n = self.count(4, field)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.u32(field)?);
        }
        Ok(v)
    }

    pub(super) fn u64s(&mut self, field: &'static str) -> Result<Vec<u64>, WireError> {
        let n = self.count(8, field)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.u64(field)?);
        }
        Ok(v)
    }

    pub(super) fn finish(self) -> Result<(), WireError> {
        let left = self.buf.len() - self.pos;
        if left != 0 {
            return Err(self.err(
                "end of fields",
                format!("{left} bytes follow the last field"),
            ));
        }
        Ok(())
    }
}

pub(super) fn no_bulk(header: &FrameHeader, bulk: Option<&Vec<u8>>) -> Result<(), WireError> {
    match bulk {
        None => Ok(()),
        Some(b) => Err(malformed(
            header,
            "bulk",
            format!(
                "a {} message has no bulk section, found {} bytes",
                type_name(header.msg_type),
                b.len()
            ),
        )),
    }
}
