-- Source: apache/datafusion benchmarks/queries/q5.sql (DataFusion's TPC-H texts).
-- Unchanged (dates are strings in Shoal: DataFusion casts a Utf8 column compared with a
-- DATE literal to Date32, and extract() casts it to a timestamp, so no CAST is needed).
-- SQLBench-H query 5 derived from TPC-H query 5 under the terms of the TPC Fair Use Policy.
-- TPC-H queries are Copyright 1993-2022 Transaction Processing Performance Council.
select
	n_name,
	sum(l_extendedprice * (1 - l_discount)) as revenue
from
	customer,
	orders,
	lineitem,
	supplier,
	nation,
	region
where
	c_custkey = o_custkey
	and l_orderkey = o_orderkey
	and l_suppkey = s_suppkey
	and c_nationkey = s_nationkey
	and s_nationkey = n_nationkey
	and n_regionkey = r_regionkey
	and r_name = 'AFRICA'
	and o_orderdate >= date '1994-01-01'
	and o_orderdate < date '1994-01-01' + interval '1' year
group by
	n_name
order by
	revenue desc;
