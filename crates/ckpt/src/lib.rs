//! ckpt
