//! The control plane: the wire protocol, the proxy listener, the receiver
//! (decode side), the sender (prefill side) and attach (other processes
//! reaching both through shared-memory rings).

pub mod attach;
pub mod protocol;
pub mod proxy;
pub mod receiver;
pub mod sender;
