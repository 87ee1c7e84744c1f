//! End-to-end tests that start real kvloop processes
