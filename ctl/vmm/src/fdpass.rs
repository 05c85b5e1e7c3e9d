//! File descriptors over a Unix stream socket (SCM_RIGHTS), with a byte payload beside them.
//! The pool sends exported memory handles this way; each message carries at most [`MAX_FDS`].

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

use crate::VmmError;

/// The most descriptors one message carries (the kernel's SCM_MAX_FD is 253).
pub const MAX_FDS: usize = 250;

fn os(op: &'static str) -> impl Fn(nix::Error) -> VmmError {
    move |e| VmmError::Os {
        op,
        source: e.into(),
    }
}

/// Sends `payload` with `fds` attached (`fds.len() <= MAX_FDS`, payload not empty).
pub fn send(sock: &UnixStream, payload: &[u8], fds: &[BorrowedFd<'_>]) -> crate::Result<()> {
    if fds.len() > MAX_FDS || payload.is_empty() {
        return Err(VmmError::Invalid(format!(
            "a message carries 1 or more payload bytes and at most {MAX_FDS} descriptors"
        )));
    }
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage] = if raw.is_empty() { &[] } else { &cmsg };
    let mut sent = sendmsg::<()>(
        sock.as_raw_fd(),
        &[IoSlice::new(payload)],
        cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(os("sending descriptors"))?;
    // The descriptors travel with the first byte; finish the payload with plain writes.
    while sent < payload.len() {
        sent += nix::sys::socket::send(sock.as_raw_fd(), &payload[sent..], MsgFlags::MSG_NOSIGNAL)
            .map_err(os("sending payload"))?;
    }
    Ok(())
}

/// Receives up to `buf.len()` payload bytes and any descriptors that came with them. Returns
/// the bytes read (0: the peer closed) and the descriptors, which the caller now owns.
pub fn recv(sock: &UnixStream, buf: &mut [u8]) -> crate::Result<(usize, Vec<OwnedFd>)> {
    let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(os("receiving descriptors"))?;
    let mut fds = Vec::new();
    for c in msg.cmsgs().map_err(os("reading control messages"))? {
        if let ControlMessageOwned::ScmRights(list) = c {
            // SAFETY: SCM_RIGHTS installed these descriptors in this process for us alone.
            fds.extend(
                list.into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    let truncated = msg.flags.contains(MsgFlags::MSG_CTRUNC);
    let n = msg.bytes;
    if truncated {
        return Err(VmmError::Invalid(
            "descriptors were dropped: the sender attached more than MAX_FDS".into(),
        ));
    }
    Ok((n, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsFd;

    #[test]
    fn descriptors_arrive_with_their_payload_and_stay_usable() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut files: Vec<std::fs::File> = (0..3)
            .map(|i| {
                let mut f = tempfile_in_tmp();
                write!(f, "file {i}").unwrap();
                f
            })
            .collect();
        let borrowed: Vec<BorrowedFd> = files.iter().map(|f| f.as_fd()).collect();
        send(&a, b"three", &borrowed).unwrap();
        drop(borrowed);
        files.clear(); // the receiver's copies must keep the files alive
        let mut buf = [0u8; 16];
        let (n, fds) = recv(&b, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"three");
        assert_eq!(fds.len(), 3);
        for (i, fd) in fds.into_iter().enumerate() {
            let mut f = std::fs::File::from(fd);
            f.rewind().unwrap();
            let mut s = String::new();
            f.read_to_string(&mut s).unwrap();
            assert_eq!(s, format!("file {i}"));
        }
    }

    #[test]
    fn too_many_descriptors_or_no_payload_is_refused_before_sending() {
        let (a, _b) = UnixStream::pair().unwrap();
        let f = tempfile_in_tmp();
        let many: Vec<BorrowedFd> = (0..MAX_FDS + 1).map(|_| f.as_fd()).collect();
        assert!(matches!(send(&a, b"x", &many), Err(VmmError::Invalid(_))));
        assert!(matches!(send(&a, b"", &[]), Err(VmmError::Invalid(_))));
    }

    #[test]
    fn a_closed_peer_reads_as_zero_bytes() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        let mut buf = [0u8; 4];
        let (n, fds) = recv(&b, &mut buf).unwrap();
        assert_eq!((n, fds.len()), (0, 0));
    }

    fn tempfile_in_tmp() -> std::fs::File {
        let path = std::env::temp_dir().join(format!(
            "valve-fdpass-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }
}
