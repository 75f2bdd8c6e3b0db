//! Finding the RDMA device: [`probe`] lists what the verbs library sees and
//! turns "nothing here" (no kernel support, no device, no such name) into a
//! [`TransportError::NoDevice`] that says why.

use crate::transport::TransportError;

/// Names of the RDMA devices on this host (`ibv_get_device_list`), or
/// [`TransportError::NoDevice`] with the reason: the call failed (on a
/// kernel without RDMA support it fails with ENOSYS, "Function not
/// implemented") or the list is empty.
pub fn probe() -> Result<Vec<String>, TransportError> {
    let list = ibverbs::devices().map_err(|e| no_device(&format!("ibv_get_device_list: {e}")))?;
    let names: Vec<String> = list
        .iter()
        .map(|d| {
            d.name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
        .collect();
    if names.is_empty() {
        return Err(no_device("ibv_get_device_list returned no devices"));
    }
    Ok(names)
}

/// The [`TransportError::NoDevice`] for `cause`, with the hint where to look.
pub fn no_device(cause: &str) -> TransportError {
    TransportError::NoDevice(format!(
        "no RDMA device was found ({cause}); kvferry's rdma transport needs an RDMA NIC \
         or a soft-RoCE device (rdma_rxe), see docs/rdma.md"
    ))
}

/// Index in `names` of the device to open: the one called `want`, or the
/// first. [`TransportError::NoDevice`] if `want` is not there (the message
/// lists what is) or `names` is empty.
pub fn pick_device(names: &[String], want: Option<&str>) -> Result<usize, TransportError> {
    match want {
        None if names.is_empty() => Err(no_device("ibv_get_device_list returned no devices")),
        None => Ok(0),
        Some(w) => names.iter().position(|n| n == w).ok_or_else(|| {
            TransportError::NoDevice(format!(
                "RDMA device `{w}` not found (devices here: {})",
                if names.is_empty() {
                    "none".to_owned()
                } else {
                    names.join(", ")
                }
            ))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_named_or_the_first_device() {
        let names = vec!["mlx5_0".to_owned(), "rxe0".to_owned()];
        assert_eq!(pick_device(&names, None).unwrap(), 0);
        assert_eq!(pick_device(&names, Some("rxe0")).unwrap(), 1);
        let err = pick_device(&names, Some("rxe9")).unwrap_err();
        assert!(
            matches!(&err, TransportError::NoDevice(m) if m.contains("rxe9") && m.contains("mlx5_0, rxe0")),
            "{err}"
        );
        let err = pick_device(&[], Some("rxe0")).unwrap_err();
        assert!(err.to_string().contains("devices here: none"), "{err}");
        let err = pick_device(&[], None).unwrap_err();
        assert!(
            err.to_string().contains("no RDMA device was found"),
            "{err}"
        );
    }

    #[test]
    fn probe_either_lists_devices_or_says_why_not() {
        match probe() {
            Ok(names) => assert!(!names.is_empty()),
            Err(TransportError::NoDevice(m)) => {
                assert!(m.contains("no RDMA device was found"), "{m}");
                assert!(m.contains("ibv_get_device_list"), "{m}");
            }
            Err(other) => panic!("probe failed with an unexpected error: {other}"),
        }
    }
}
