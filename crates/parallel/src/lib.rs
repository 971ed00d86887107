//! parallel
