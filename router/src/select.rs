//! P/D selection by predicted TTFT (issue 13 item 2). Pure: placeholder.
