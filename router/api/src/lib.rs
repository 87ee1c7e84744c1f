//! Wire types of the router's admin API (threshold pushes), shared by router and agent
